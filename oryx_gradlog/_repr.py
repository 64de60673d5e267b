"""Short `repr`s of the result types: arrays as their dtype and shape.

`print(projector)` would otherwise print every number of every array it holds.

Sharp edges:
  * A number or a vector of at most `SHOWN` numbers is shown by value, any other
    array as `float32[64, 16]`; read the numbers from the attributes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

SHOWN = 6


def short(value: Any) -> str:
  """`value` in one short line: arrays as `dtype[shape]` (or their few numbers)."""
  if hasattr(value, "shape") and hasattr(value, "dtype"):
    if np.ndim(value) <= 1 and np.size(value) <= SHOWN:
      return np.array2string(np.asarray(value), separator=", ", max_line_width=10**6)
    return f"{np.dtype(value.dtype).name}{list(value.shape)}"
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k!r}: {short(v)}" for k, v in value.items()) + "}"
  if isinstance(value, (tuple, list)):
    inner = ", ".join(short(v) for v in value)
    return f"({inner}{',' if len(value) == 1 else ''})" if isinstance(value, tuple) else f"[{inner}]"
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return dataclass_repr(value)
  return repr(value)


def dataclass_repr(obj: Any) -> str:
  """`Name(field=..., ...)` with every field `short`; a dataclass's `__repr__`."""
  fields = ", ".join(f"{f.name}={short(getattr(obj, f.name))}"
                     for f in dataclasses.fields(obj) if f.repr)
  return f"{type(obj).__name__}({fields})"
