"""The type of a vectorized cost term's value, named once for every term's return annotation."""

from typing import TypeAlias

import numpy as np

# One value per candidate: an array when the term is given arrays (the search), a float (a numpy
# scalar, a subclass of float, included) when it is given scalars (one layout, the executor's proxy).
ArrayOrFloat: TypeAlias = float | np.ndarray
