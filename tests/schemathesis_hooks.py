"""Loaded by the schemathesis run in test_api.py (SCHEMATHESIS_HOOKS): every JSON response must
be strict RFC 8259 JSON. Python's json.loads reads NaN and Infinity, which are not JSON."""

import json
import os

import schemathesis

CHECKED = os.environ.get("STRICT_JSON_CHECKED")  # a file: one line per response checked


def _refuse(name: str):
    raise AssertionError(f"{name} in a JSON response: not JSON (use null)")


@schemathesis.check
def strict_json(ctx, response, case):
    kind = response.headers.get("content-type") or response.headers.get("Content-Type") or [""]
    kind = kind[0] if isinstance(kind, list) else kind
    if "json" in kind and response.content:
        json.loads(response.content, parse_constant=_refuse)
        if CHECKED:
            with open(CHECKED, "a") as f:
                f.write(f"{response.status_code}\n")
