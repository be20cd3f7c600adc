"""Pure, vectorized cost terms. Every function takes numpy arrays over candidates (plus the specs)
and returns arrays; none has side effects. Each docstring names its source."""
