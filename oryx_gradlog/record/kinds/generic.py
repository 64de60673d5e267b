"""The generic kind: any operation, each example's gradient by its own vjp.

The explicit entry for every primitive that no other kind registers (and for uses
that the other kinds decline): `Kind`'s defaults, exact for any operation. Its
per-example gradients are formed with the vjp at one example's cotangent at a time.
"""

from oryx_gradlog.record._kinds import GENERIC
from oryx_gradlog.record.kinds import Kind, register


class Generic(Kind):
  name = GENERIC


KIND = register(Generic())
