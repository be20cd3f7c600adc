"""`berth serve` in its own process on a free loopback port, for the tests that talk to it over HTTP
(tests/test_api.py, tests/test_security.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`berth serve` in its own process."""

    def __init__(self, store, extra_env=None, workers=1, **env):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full = {
            **os.environ,
            "BERTH_STORE_PATH": str(store),
            **(extra_env or {}),
            **{f"BERTH_{k.upper()}": str(v) for k, v in env.items()},
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "berth.cli.main", "serve", "--port", str(self.port), "--workers", str(workers)],
            env=full,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 90  # a loaded 2-core machine can take 30 s to import
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not start: " + self.proc.stderr.read().decode()[-2000:])

    def kill9(self):
        """kill -9 the server process (what a crash or the OOM killer does)."""
        self.proc.kill()
        self.proc.wait()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
