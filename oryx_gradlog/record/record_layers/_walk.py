"""The classifying walk: one interpreter over the jaxpr at batch B (in lockstep with
the one at 2B where one trace did not tell the batch axes).

Each value is classified (parameter, data, constant; its batch axis; its lineage
back to a parameter leaf; the use whose output it is) by one rule per kind of
equation, kept in `_RULES` keyed by the JAX primitive objects (`_internals`); an
equation where parameters meet the batch is a use, whose kind the table of kinds
(`kinds/`) decides. An element-wise add of a parameter to a dense or convolution
use's output, varying along its features only, is that layer's bias (`shifts`); where
it is the only reader of that output (`sole`), one record site serves both.
The record sites of a hand-marked layer (`gl.dense`, ...) are noted so that the
emitter records the layer once, as its uses. Equations with bodies the walk enters (`jit`, `scan`, `cond`,
`remat`) have rules of their own; every other equation, with bodies or without, is
one operation (`_first_order`): a parameter entering a `custom_vjp` or a
`while_loop` with a batched output is a generic use of the whole call.

Sharp edges:
  * A batch axis is one that doubles at 2B: propagated from one trace
    (`_propagate`), or read from the second trace, where code whose structure
    depends on the batch size is an error (`_TraceMismatch`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

from oryx_gradlog.record import _internals, _sites, kinds
from oryx_gradlog.record._kinds import CONV, DENSE, ELEMENTWISE, GENERIC, UNSUPPORTED
from oryx_gradlog.record._layers import LayerInputs
from oryx_gradlog.record.record_layers._spec import (
    _LINEAR, Chain, Lineage, Step, _paths)


# ----------------------------------------------------------------------------------
# Classification of the values of a jaxpr.

IRREGULAR = "irregular"


@dataclasses.dataclass(frozen=True)
class Info:
  """What the analysis knows of one value.

  Attributes:
    params: the parameter leaves it depends on.
    data: whether it depends on the batch arguments.
    batch: its batch axis `(axis, factor)`, `None`, or `IRREGULAR`.
    lineage: for a value of parameters alone, its `Lineage` or `Chain` (`None`
      where it has neither: a parameter carried through a loop).
    coupled: whether examples are mixed in it (reduced over the batch and used per
      example again, or an axis that is not the batch's).
  """

  params: frozenset = frozenset()
  data: bool = False
  batch: Any = None
  lineage: Any = None
  coupled: bool = False
  producer: tuple | None = None  # The path of the use whose output it is.

  @property
  def is_param(self) -> bool:
    return bool(self.params) and not self.data and self.batch is None


_CONST = Info()


def _batch_axis(aval1, aval2, batch_size: int):
  """`(axis, factor)` of the one axis that doubles from `aval1` to `aval2`."""
  shape1, shape2 = getattr(aval1, "shape", None), getattr(aval2, "shape", None)
  if shape1 == shape2:
    return None
  if shape1 is None or shape2 is None or len(shape1) != len(shape2):
    return IRREGULAR
  axes = []
  for axis, (n1, n2) in enumerate(zip(shape1, shape2)):
    if n1 == n2:
      continue
    if n2 != 2 * n1 or n1 % batch_size:
      return IRREGULAR
    axes.append((axis, n1 // batch_size))
  return axes[0] if len(axes) == 1 else IRREGULAR


def _where(eqn) -> str:
  """The primitive and, where JAX kept it, the user's source line."""
  line = _internals.source_line(eqn)
  return f"{eqn.primitive.name}" + (f" ({line})" if line else "")


def _static_params(params: dict) -> tuple:
  return tuple(sorted(params.items()))


@dataclasses.dataclass
class _Use:
  """A use found by the analysis, before it is named (internal)."""

  eqn: Any
  kind: str
  param_args: tuple
  lineages: tuple
  chain: Chain | None
  batch: tuple
  out_batch: Any
  calls: tuple
  reason: str = ""
  leaves: frozenset = frozenset()  # The parameter leaves its parameter operands read.
  shifts: tuple | None = None  # A bias's: the path of the use whose output it shifts.
  sole: bool = False  # A bias's: it is the only reader of that use's output.

  def paths(self) -> tuple[str, ...]:
    return _paths((*self.lineages, self.chain))


class _TraceMismatch(Exception):
  """The traces at batch B and 2B differ in structure; its message says where."""


def _mismatch(jaxpr1, jaxpr2, batch_size: int) -> _TraceMismatch:
  """Where the two traces part: their first equation that differs (with the user's
  source line where JAX kept it), or the first one that only one of them has."""
  for k, (e1, e2) in enumerate(zip(jaxpr1.eqns, jaxpr2.eqns)):
    if e1.primitive is not e2.primitive or len(e1.outvars) != len(e2.outvars):
      return _TraceMismatch(f"{_where(e1)} at batch {batch_size}, "
                            f"{_where(e2)} at batch {2 * batch_size}")
  k = min(len(jaxpr1.eqns), len(jaxpr2.eqns))
  extra, size = ((jaxpr1.eqns[k], batch_size) if len(jaxpr1.eqns) > k
                 else (jaxpr2.eqns[k], 2 * batch_size))
  return _TraceMismatch(f"{_where(extra)} only at batch {size}")


class _Analysis:
  """Walks the jaxpr at batch B (and its twin at 2B, or itself where the batch axes
  come from one trace), classifies values, finds uses.

  Equations are identified by their path: indices of the equation and of the
  enclosing equations (and cond branches), outermost first, which is also how the
  interpreter finds them. The path of a body's invocation is that of its equation.
  """

  def __init__(self, batch_size: int, propagation=None):
    self.batch_size = batch_size
    # The batch axes from one trace (`_propagate`), or `None`: from the two traces.
    self.propagation = propagation
    self.uses: dict[tuple, _Use] = {}
    self.inline: set[tuple] = set()  # Equations with uses or chains inside.
    self.coupling = ""  # Where examples are first mixed, if anywhere.
    self.marked: set[tuple] = set()  # The sites of hand-marked layers.
    self.marked_names: set[tuple] = set()  # Their (name, tag)s.
    # The layers recorded by their bias's site, by path: the bias's path.
    self.paired: dict[tuple, tuple] = {}

  def run(self, jaxpr1, jaxpr2, in_infos, invocation=(), calls=()):
    """Returns the infos of `jaxpr1`'s outputs, given those of its inputs."""
    env = dict(zip(jaxpr1.invars, in_infos))
    read = lambda v: _CONST if isinstance(v, jax.extend.core.Literal) else env.get(v, _CONST)
    if len(jaxpr1.eqns) != len(jaxpr2.eqns):
      raise _mismatch(jaxpr1, jaxpr2, self.batch_size)
    biases = []
    for k, (e1, e2) in enumerate(zip(jaxpr1.eqns, jaxpr2.eqns)):
      if e1.primitive is not e2.primitive or len(e1.outvars) != len(e2.outvars):
        raise _mismatch(jaxpr1, jaxpr2, self.batch_size)
      ins = [read(v) for v in e1.invars]
      batches = [self.batch(invocation, v1, v2) for v1, v2 in zip(e1.outvars, e2.outvars)]
      rule = _RULES.get(e1.primitive, _first_order)
      outs = rule(self, e1, e2, ins, batches, invocation, invocation + (k,), calls)
      env.update(zip(e1.outvars, outs))
      use = self.uses.get(invocation + (k,))
      if use is not None and use.shifts is not None and use.shifts[:-1] == invocation:
        biases.append(use)
    if biases:
      _note_sole_readers(jaxpr1, biases, self.uses)
    return [read(v) for v in jaxpr1.outvars]

  def batch(self, invocation, v1, v2):
    """The batch axis of `v1` (of the jaxpr at `invocation`); `v2` is its twin at 2B."""
    if self.propagation is not None:
      return self.propagation.batch_of(invocation, v1)
    return _batch_axis(v1.aval, v2.aval, self.batch_size)

  def mark(self, path):
    for i in range(1, len(path)):
      self.inline.add(path[:i])

  def add_use(self, path, use: _Use):
    self.uses[path] = use
    self.mark(path)


def _note_sole_readers(jaxpr, biases, uses) -> None:
  """Notes the biases (`_Use.sole`) that are the only reader of their layer's output
  in `jaxpr`: its cotangent is then the bias add's, and one record site serves both."""
  readers = collections.Counter(
      v for v in (*(v for e in jaxpr.eqns for v in e.invars), *jaxpr.outvars)
      if isinstance(v, jax.extend.core.Var))
  for bias in biases:
    (out,) = uses[bias.shifts].eqn.outvars
    bias.sole = (readers[out] == 1 and out in bias.eqn.invars
                 and out.aval.shape == bias.eqn.outvars[0].aval.shape)


def _join(infos, batch=None) -> Info:
  return Info(params=frozenset().union(*(i.params for i in infos)),
              data=any(i.data for i in infos), batch=batch,
              coupled=any(i.coupled for i in infos))


def _chain_of(invocation, eqn, ins, target) -> Chain:
  """The chain computing `target` (an output of `eqn`) from its inputs' lineages."""
  keys, eqns, aliases = {}, {}, {}
  for var, info in zip(eqn.invars, ins):
    if isinstance(var, jax.extend.core.Literal):
      continue
    if isinstance(info.lineage, Chain):
      for key, lineage in zip(info.lineage.keys, info.lineage.inputs):
        keys.setdefault(key, lineage)
      eqns.update(((i, id(e)), (i, e)) for i, e in info.lineage.eqns)
      aliases.update(info.lineage.aliases)
    else:
      keys.setdefault((invocation, var), info.lineage if info.is_param else None)
  eqns[(invocation, id(eqn))] = (invocation, eqn)
  return Chain(tuple(keys), tuple(keys.values()), tuple(eqns.values()), target,
               aliases=tuple(aliases.items()))


def _first_order(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  """Any equation whose bodies (if it has any) are not looked into."""
  param_args = tuple(i for i, info in enumerate(ins) if info.is_param)
  data = any(i.data for i in ins)
  batched = any(b is not None for b in batches)
  # Examples mix where a batched output takes data reduced over the batch.
  coupling = any(b == IRREGULAR for b in batches) or (
      batched and any(i.data and i.batch is None for i in ins))
  coupled = coupling or any(i.coupled for i in ins)
  if coupling and not analysis.coupling:
    analysis.coupling = _where(eqn)
  if param_args and batched:  # Parameters meet the batch: a use.
    use = _classify(eqn, ins, batches, param_args, calls, coupled)
    use.shifts = _shifted(analysis, eqn, ins, use)
    analysis.add_use(path, use)
    if len(batches) == 1:
      return [dataclasses.replace(_join(ins, batches[0]), coupled=coupled, producer=path)]
  elif param_args and not data:  # A function of parameters alone.
    if (len(ins) == 1 and len(eqn.outvars) == 1 and eqn.primitive.name in _LINEAR
        and isinstance(ins[0].lineage, Lineage)):
      aval = eqn.invars[0].aval
      step = Step("view", eqn.primitive, _static_params(eqn.params), tuple(aval.shape),
                  aval.dtype)
      return [dataclasses.replace(ins[0], lineage=ins[0].lineage.then(step))]
    analysis.mark(path)
    base = _join(ins)
    return [dataclasses.replace(base, lineage=_chain_of(invocation, eqn, ins, (invocation, v)))
            for v in eqn.outvars]
  elif param_args:  # Parameters meet data with no batch axis.
    analysis.add_use(path, _Use(
        eqn, UNSUPPORTED, param_args, tuple(ins[i].lineage for i in param_args), None,
        tuple(i.batch for i in ins), None, calls,
        reason="it meets data that has no batch axis (a term added to the batch loss, "
               "or statistics over the batch), so it has no per-example gradient",
        leaves=frozenset().union(*(ins[i].params for i in param_args))))
  return [_join(ins, b) if b is None else dataclasses.replace(_join(ins, b), coupled=coupled)
          for b in batches]


def _shifted(analysis, eqn, ins, use: _Use) -> tuple | None:
  """For a bias (`y + b`: an element-wise add to the output of a dense or convolution
  use of a parameter broadcast along all but the output's feature axes), the path
  of that use."""
  if (use.kind != ELEMENTWISE or eqn.primitive not in (jax.lax.add_p, _internals.add_any_p)
      or len(ins) != 2 or len(use.param_args) != 1 or use.lineages[0] is None):
    return None
  data = ins[1 - use.param_args[0]]
  producer = analysis.uses.get(data.producer) if data.producer is not None else None
  if producer is None or producer.kind not in (DENSE, CONV):
    return None
  features = kinds.of(producer.kind).feature_axes(producer.eqn, producer.param_args[0])
  out_shape = eqn.outvars[0].aval.shape
  steps = use.lineages[0].steps
  if steps and steps[-1].primitive is jax.lax.broadcast_in_dim_p:  # Broadcast, then added.
    dims, shape = dict(steps[-1].params)["broadcast_dimensions"], steps[-1].in_shape
  else:  # Added with size-1 axes (or as a scalar), which `add` broadcasts itself.
    shape = eqn.invars[use.param_args[0]].aval.shape
    dims = range(len(shape)) if len(shape) == len(out_shape) else ()
  if features is None or (shape and not dims):
    return None
  varies = {d for d, n in zip(dims, shape) if n > 1}
  return data.producer if varies == {a for a in features if out_shape[a] > 1} else None


def _classify(eqn, ins, batches, param_args, calls, coupled) -> _Use:
  """The kind of a use, or why it is unsupported."""
  lineages = tuple(ins[i].lineage for i in param_args)
  chains = [l for l in lineages if isinstance(l, Chain)]
  out_batch = batches[0] if len(batches) == 1 else IRREGULAR
  use = _Use(eqn, GENERIC, param_args,
             tuple(l if isinstance(l, Lineage) else None for l in lineages),
             chains[0] if chains else None, tuple(i.batch for i in ins), out_batch, calls,
             leaves=frozenset().union(*(ins[i].params for i in param_args)))
  reason = ""
  if len(batches) > 1:
    reason = ("the operation has several outputs (a custom_jvp/custom_vjp function or "
              "a loop holding the parameter); apply it to the parameter outside, or "
              "give it one output")
  elif coupled or out_batch == IRREGULAR or any(i.batch == IRREGULAR for i in ins):
    reason = ("its output mixes examples (a value reduced over the batch, or an axis "
              "that is not the batch's), so it has no per-example gradient")
  elif any(l is None for l in lineages):
    reason = ("it takes a function of parameters carried through a loop or returned by "
              "a cond; compute it where it is used")
  elif any(c.crossed for c in chains):
    reason = ("it takes a function of parameters computed outside the scan, cond or "
              "remat it is in; compute it inside (views such as reshapes and casts "
              "may cross)")
  elif chains and len(param_args) > 1:
    reason = "it takes several parameter operands made by functions of parameters"
  if reason:
    use.kind, use.reason = UNSUPPORTED, reason
    return use
  if len(param_args) == 1 and len(batches) == 1:
    use.kind = kinds.classify(eqn, ins, param_args[0])
  return use


def _reshape(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  """A reshape keeps a batch axis only as the outer factor of the axis it lands in."""
  outs = _first_order(analysis, eqn, eqn2, ins, batches, invocation, path, calls)
  (info,), (out,) = ins, outs
  if info.batch in (None, IRREGULAR) or out.batch in (None, IRREGULAR):
    return outs
  in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
  if math.prod(in_shape[:info.batch[0]]) != math.prod(out_shape[:out.batch[0]]):
    return [dataclasses.replace(out, batch=IRREGULAR, coupled=True)]
  return outs


def _cross(info: Info, step: Step | None) -> Info:
  """The info of a value passed into a body: lineages cross, chains are marked."""
  if not info.is_param:
    return info
  if isinstance(info.lineage, Lineage):
    return dataclasses.replace(
        info, lineage=info.lineage if step is None else info.lineage.then(step))
  if isinstance(info.lineage, Chain):
    return dataclasses.replace(info, lineage=dataclasses.replace(info.lineage, crossed=True))
  return info


def _with_batches(outs, batches):
  return [dataclasses.replace(o, batch=b) for o, b in zip(outs, batches)]


def _renamed(info: Info, invocation, var) -> Info:
  """`info` of a value that a `jit` boundary renames to `var` in `invocation` (chains
  follow)."""
  if isinstance(info.lineage, Chain) and isinstance(var, jax.extend.core.Var):
    return dataclasses.replace(info, lineage=info.lineage.renamed((invocation, var)))
  return info


def _jit(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  """A `jit` body is looked into as if inlined (and inlined where it holds uses)."""
  body = eqn.params["jaxpr"].jaxpr
  outs = analysis.run(body, eqn2.params["jaxpr"].jaxpr,
                      [_renamed(i, path, v) for i, v in zip(ins, body.invars)], path, calls)
  outs = [_renamed(o, invocation, v) for o, v in zip(outs, eqn.outvars)]
  return _with_batches(outs, batches)


def _remat(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  outs = analysis.run(eqn.params["jaxpr"], eqn2.params["jaxpr"],
                      [_cross(i, None) for i in ins], path, calls)
  # A function of parameters made in the body is, outside it, the whole remat call
  # (the body's own values live in the checkpoint's trace).
  outs = [dataclasses.replace(o, lineage=_chain_of(invocation, eqn, ins, (invocation, v)))
          if isinstance(o.lineage, Chain) else o for o, v in zip(outs, eqn.outvars)]
  return _with_batches(outs, batches)


def _cond(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  operands = [_cross(i, None) for i in ins[1:]]
  outs = [analysis.run(b1.jaxpr, b2.jaxpr, operands, path + (b,), calls)
          for b, (b1, b2) in enumerate(zip(eqn.params["branches"], eqn2.params["branches"]))]
  return [dataclasses.replace(_join([ins[0], *infos], b), lineage=None)
          for infos, b in zip(zip(*outs), batches)]


def _scan(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  params = eqn.params
  body1, body2 = params["jaxpr"].jaxpr, eqn2.params["jaxpr"].jaxpr
  n_consts, n_carry, length = params["num_consts"], params["num_carry"], params["length"]
  consts = [_cross(i, Step("tied", length=length)) for i in ins[:n_consts]]
  # A carry the body passes on unchanged (as Flax NNX 0.10's `nnx.RNN` carries its
  # cell's parameters) is a constant of the loop, and keeps its lineage as one.
  invariant = [body1.outvars[k] is body1.invars[n_consts + k] for k in range(n_carry)]
  carry = [_cross(i, Step("tied", length=length)) if same
           else dataclasses.replace(i, lineage=None)
           for i, same in zip(ins[n_consts:n_consts + n_carry], invariant)]
  xs = [_cross(i, Step("stacked", in_shape=tuple(v.aval.shape), length=length))
        for i, v in zip(ins[n_consts + n_carry:], eqn.invars[n_consts + n_carry:])]

  def body_infos(infos):  # Batch axes inside the body, from its own shapes.
    return [dataclasses.replace(
        i, batch=analysis.batch(path, v1, v2))
        for i, v1, v2 in zip(infos, body1.invars, body2.invars)]

  for _ in range(len(carry) + 2):  # The carry's classes are a fixed point of the body.
    for stale in [p for p in analysis.uses if p[:len(path)] == path]:
      del analysis.uses[stale]  # Found with an earlier guess of the carry's classes.
    outs = analysis.run(body1, body2, body_infos(consts + carry + xs), path,
                        calls + ((path, length),))
    new = [c if same else dataclasses.replace(_join([c, o]), lineage=None)
           for c, o, same in zip(carry, outs[:n_carry], invariant)]
    if [(n.params, n.data, n.coupled) for n in new] == [
        (c.params, c.data, c.coupled) for c in carry]:
      break
    carry = new
  ys = [dataclasses.replace(o, lineage=None) for o in outs[n_carry:]]
  return _with_batches(carry + ys, batches)


def _identity(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  """Record sites and Oryx sows: identities on their operands (after any residuals)."""
  n = len(ins) - len(eqn.outvars)
  return _with_batches(ins[n:], batches)


def _site(analysis, eqn, eqn2, ins, batches, invocation, path, calls):
  """A record site: an identity. The two sites of a hand-marked layer (`gl.dense`,
  ...: its inputs, a `LayerInputs`, and its output) are noted, so that the emitter
  records the layer once, as the uses found in it, not a second time by name."""
  params = eqn.params
  key = (params["name"], params["tag"])
  if params["component"] == _sites.INPUTS and _holds_layer(params["treedef"]):
    analysis.marked_names.add(key)
    analysis.marked.add(path)
  elif params["component"] == _sites.OUTPUT and key in analysis.marked_names:
    analysis.marked.add(path)
  if path in analysis.marked:
    analysis.mark(path)
  return _identity(analysis, eqn, eqn2, ins, batches, invocation, path, calls)


def _holds_layer(treedef) -> bool:
  tree = treedef.unflatten([None] * treedef.num_leaves)
  return any(isinstance(leaf, LayerInputs) for leaf in jax.tree.leaves(
      tree, is_leaf=lambda v: v is None or isinstance(v, LayerInputs)))


# The rules of the equations the walk treats otherwise than as one operation
# (`_first_order`, the rule of every other primitive), keyed by primitive.
_RULES: dict[Any, Callable] = {
    _sites.site_p: _site,
    _sites.after_p: _identity,
    _sites.batch_first_p: _identity,
    _sites.cotangent_p: _identity,
    _internals.sow_p: _identity,
    jax.lax.reshape_p: _reshape,
    _internals.jit_p: _jit,
    _internals.closed_call_p: _jit,
    _internals.call_p: _jit,
    _internals.remat_p: _remat,
    _internals.cond_p: _cond,
    _internals.scan_p: _scan,
}
