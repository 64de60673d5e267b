"""Flax NNX modules as arguments of a reaped function.

A reap runs the user's function under an Oryx harvest trace. Flax NNX (0.11 and
newer) refuses to use a module's variables under a trace other than the one they
were made under ("Cannot extract graph node from different trace level"), so
`gl.call_and_reap(nnx.grad(loss))(model, x, y)` inside `nnx.jit` would fail. The
reaper therefore passes NNX graph nodes through the harvest trace the way NNX's
own transforms do: `nnx.split` before it, `nnx.merge` (copying the variables)
inside, and `nnx.update` of the caller's modules afterwards, so state the function
changes (batch statistics, an optimizer step) reaches the caller's objects. NNX
objects in the result (the State that `nnx.grad` returns) are remade outside.

Sharp edges:
  * Only arguments that are graph nodes, or pytrees holding them, are split; a
    module captured in a closure is used as it is and meets NNX's check.
  * Flax is never imported here: without `flax.nnx` already imported, arguments
    pass unchanged.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import jax


class Arguments:
  """The arguments of a reaped call, with any NNX graph nodes split off."""

  def __init__(self, args: tuple, kwargs: dict):
    self._tree = (args, kwargs)
    self._nnx = sys.modules.get("flax.nnx")
    self._nodes = []
    if self._nnx is not None:
      is_node = self._nnx.graph.is_graph_node
      leaves, self._treedef = jax.tree.flatten(self._tree, is_leaf=is_node)
      self._positions = [i for i, leaf in enumerate(leaves) if is_node(leaf)]
      self._leaves = leaves
      self._nodes = [leaves[i] for i in self._positions]
    if self._nodes:
      self._graphdef, self._state = self._nnx.split(self._nodes)
      # NNX 0.12 `merge` reuses the Variable objects unless asked to copy them;
      # older NNX always makes new ones (and has no `copy`).
      copy = "copy" in inspect.signature(self._nnx.merge).parameters
      self._merge_kwargs = {"copy": True} if copy else {}
    self._merged = None

  def inside(self) -> tuple[tuple, dict]:
    """The arguments to call with inside the trace: graph nodes merged there."""
    if not self._nodes:
      return self._tree
    self._merged = self._nnx.merge(self._graphdef, self._state, **self._merge_kwargs)
    leaves = list(self._leaves)
    for position, node in zip(self._positions, self._merged):
      leaves[position] = node
    return jax.tree.unflatten(self._treedef, leaves)

  def outside(self, out: Any) -> Any:
    """After the trace: updates the caller's graph nodes with the state the call
    left them in, and returns `out` with NNX objects remade in the caller's trace
    (`nnx.grad` returns a State of Variables, which NNX ties to the trace that
    made them)."""
    if self._merged is None:
      return out
    self._nnx.update(self._nodes, self._nnx.state(self._merged))
    return jax.tree.map(lambda leaf: leaf, out)
