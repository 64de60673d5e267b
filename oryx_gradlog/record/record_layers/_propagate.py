"""Batch axes from one trace: which axes of each value scale with the batch size.

The walk (`_walk.py`) needs, for every value of the jaxpr at batch B, the axis that
would double at batch 2B. Tracing the function a second time at 2B answers that for
any function; this module answers it from the one trace, by propagating from the
batch arguments' leading axes through the equations, one rule per kind of
primitive (`_RULES`), into the bodies of `jit`, `scan`, `cond`, `remat` and custom
derivatives. Where it cannot tell, it raises `Ambiguous`, and `record_layers` traces
again at 2B as it always has.

Each axis is unscaled (`None`) or scaled: scaled for certain (`DATA`, carried from
the batch) or scaled if a guess holds (the set of the guesses it depends on).

Guesses: an axis made by an equation rather than carried from an operand (a
`broadcast_in_dim` to `(len(x), d)`, `jnp.zeros` of an RNN's initial carry, an
`iota`, a captured constant) scales with the batch only if the code made it from
the batch size, which the jaxpr does not say. A made axis whose size is B is taken
as a guess, and a guess counts only once it meets the batch: an element-wise
operation, a contraction, a `cond`'s branches or a loop's carry pairs it with an
axis scaled for certain. Any other made axis is taken as unscaled. Wherever an
unscaled axis meets a scaled one (a wrong guess either way, or code that would
not trace at 2B), or a guess is never confirmed, it is `Ambiguous`.

Sharp edges:
  * The rules give what the second trace gives for a function whose structure does
    not depend on the batch size (the tests check every walk of the suite against
    it). A function whose structure does depend on it is recorded as it traces at B
    where the rules tell its batch axes, and is an error (as before) where
    `record_layers` falls back to the second trace.
  * Ambiguous (the second trace): a batch of 1; a made value with two axes of the
    batch's size (a sequence as long as the batch); `reshape`s that split the
    batch; slices, pads, concatenations, gathers and scatters along it; `scan`s over
    it; primitives without a rule that take batched values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from oryx_gradlog.record import _internals, _sites

DATA = frozenset()  # A batch axis for certain (no guess behind it).
IRREGULAR = "irregular"


class Ambiguous(Exception):
  """One trace cannot tell the batch axes here; trace again at 2B."""


def _shape(v) -> tuple:
  return tuple(getattr(v.aval, "shape", ()))


class Propagation:
  """The batch axes of every value of one jaxpr (and its bodies), from one trace.

  Values are keyed as the walk keys them: `(invocation, var)`, where `invocation`
  is the path of the equation whose body holds `var` (`()` at the top, a `cond`
  branch adding its index).
  """

  def __init__(self, batch_size: int):
    if batch_size < 2:
      raise Ambiguous("a batch of one: every axis of size 1 could be the batch's")
    self.batch_size = batch_size
    self.states: dict[tuple, tuple] = {}
    self.guesses: set = set()
    self.confirmed: set = set()

  def batch_of(self, invocation: tuple, var) -> Any:
    """The walk's batch axis of `var`: `None`, `(axis, factor)` or `IRREGULAR`."""
    state = self.states.get((invocation, var))
    if state is None:  # A value the rules did not reach: the walk traces again.
      raise Ambiguous(f"no batch axes for {var} at {invocation}")
    scaled = [a for a, s in enumerate(state) if s is not None]
    if not scaled:
      return None
    size = _shape(var)[scaled[0]]
    if len(scaled) > 1 or size % self.batch_size:
      return IRREGULAR
    return scaled[0], size // self.batch_size

  def run(self, jaxpr, in_states: Sequence[tuple], invocation: tuple = ()) -> list:
    """Propagates `in_states` (of `jaxpr.invars`) through `jaxpr`; its outputs' states."""
    env = dict(zip(jaxpr.invars, in_states))

    def read(v):
      if isinstance(v, jax.extend.core.Var) and v in env:
        return env[v]
      return (None,) * len(_shape(v))  # Literals and the closed-over constants.

    for i, v in enumerate(jaxpr.constvars):  # Captured arrays: their axes are made.
      env[v] = self.made([None] * len(_shape(v)), _shape(v), range(len(_shape(v))),
                         invocation + ("const", i))
    for v, s in zip(jaxpr.invars, in_states):
      self.states[(invocation, v)] = s
    for k, eqn in enumerate(jaxpr.eqns):
      rule = _RULES.get(eqn.primitive) or _RULES.get(eqn.primitive.name, _unknown)
      outs = rule(self, eqn, [read(v) for v in eqn.invars], invocation + (k,))
      for v, s in zip(eqn.outvars, outs):
        env[v] = s
        self.states[(invocation, v)] = s
    return [read(v) for v in jaxpr.outvars]

  def check(self) -> None:
    """Raises `Ambiguous` unless every guess met the batch."""
    if self.guesses - self.confirmed:
      raise Ambiguous("a made axis of the batch's size never met the batch")

  def unify(self, states: Sequence) -> Any:
    """The state of one axis that `states` (of equal size, > 1) must share."""
    scaled = [s for s in states if s is not None]
    if not scaled:
      return None
    if len(scaled) < len(states):
      raise Ambiguous("a batch axis meets an axis that is not the batch's")
    if DATA in scaled:
      self.confirmed.update(*scaled)
      return DATA
    return frozenset().union(*scaled)

  def join(self, states: Sequence[tuple], shape: tuple) -> tuple:
    """The state of a value of `shape` that values with `states` (of that shape) are
    at once: each axis unified (`unify`)."""
    return tuple(self.unify(list(axis)) if n > 1 else None
                 for axis, n in zip(zip(*states), shape))

  def made(self, state: list, shape: tuple, made_axes, key) -> tuple:
    """`state` with the axes `made_axes` (made, not carried) filled in: unscaled,
    or a guess where exactly one has the batch's size and nothing else is scaled."""
    candidates = [a for a in made_axes if shape[a] == self.batch_size]
    for a in made_axes:
      state[a] = None
    if candidates:
      if len(candidates) > 1 or _scaled(state):
        raise Ambiguous("a made axis that may be the batch's")
      self.guesses.add(key)
      state[candidates[0]] = frozenset({key})
    return tuple(state)


def _scaled(state) -> bool:
  return any(s is not None for s in state)


# ----------------------------------------------------------------------------------
# Rules: `rule(propagation, eqn, in_states, path) -> out_states`.


def _elementwise(p, eqn, ins, path):
  """Operands of the output's rank share each axis where their size is the output's
  (size-1 axes broadcast); scalars broadcast."""
  outs = []
  for v in eqn.outvars:
    shape = _shape(v)
    operands = [(s, _shape(u)) for s, u in zip(ins, eqn.invars) if len(_shape(u)) == len(shape)]
    if any(_shape(u) and len(_shape(u)) != len(shape) for u in eqn.invars):
      raise Ambiguous(f"{eqn.primitive.name}: operands of another rank")
    outs.append(tuple(
        p.unify([s[a] for s, sh in operands if sh[a] == n]) if n > 1 else None
        for a, n in enumerate(shape)))
  return outs


def _identity(p, eqn, ins, path):
  """Outputs are the last operands, unchanged (record sites, sows, barriers)."""
  return ins[len(ins) - len(eqn.outvars):]


def _broadcast_in_dim(p, eqn, ins, path):
  shape, in_shape = _shape(eqn.outvars[0]), _shape(eqn.invars[0])
  dims = eqn.params["broadcast_dimensions"]
  state = [None] * len(shape)
  for i, d in enumerate(dims):
    if in_shape[i] == shape[d]:
      state[d] = ins[0][i]
  made_axes = [a for a in range(len(shape))
               if a not in dims or in_shape[dims.index(a)] != shape[a]]
  return [p.made(state, shape, made_axes, path)]


def _iota(p, eqn, ins, path):
  shape = _shape(eqn.outvars[0])
  return [p.made([None] * len(shape), shape, range(len(shape)), path)]


def _reshape(p, eqn, ins, path):
  """The batch stays the outer factor of the axis it lands in, or it is ambiguous."""
  (state,), in_shape, shape = ins, _shape(eqn.invars[0]), _shape(eqn.outvars[0])
  scaled = [a for a, s in enumerate(state) if s is not None]
  if not scaled:
    return [(None,) * len(shape)]
  if len(scaled) > 1 or eqn.params.get("dimensions") is not None:
    raise Ambiguous("reshape of a value with several batch axes")
  (a,) = scaled
  outer, n = math.prod(in_shape[:a]), in_shape[a]
  for o, m in enumerate(shape):
    if (math.prod(shape[:o]) == outer and m > 1 and m % p.batch_size == 0
        and (m % n == 0 or n % m == 0)):
      return [tuple(state[a] if i == o else None for i in range(len(shape)))]
  raise Ambiguous("reshape that splits the batch")


def _transpose(p, eqn, ins, path):
  return [tuple(ins[0][i] for i in eqn.params["permutation"])]


def _reduce(p, eqn, ins, path):
  axes = set(eqn.params["axes"])
  return [tuple(s for a, s in enumerate(ins[0]) if a not in axes)]


def _squeeze(p, eqn, ins, path):
  dims = {d % len(ins[0]) for d in eqn.params["dimensions"]}
  return [tuple(s for a, s in enumerate(ins[0]) if a not in dims)]


def _same_shape(p, eqn, ins, path):
  """Operands of one shape, outputs of that shape (sorts, cumulative sums)."""
  return [p.join(ins, _shape(eqn.invars[0]))] * len(eqn.outvars)


def _resized(p, eqn, ins, path):
  """Outputs of the operand's rank, an axis kept where its size is unchanged and
  made where it changed (slices, pads, dynamic slices, `top_k`)."""
  state, in_shape = ins[0], _shape(eqn.invars[0])
  outs = []
  for k, v in enumerate(eqn.outvars):
    shape = _shape(v)
    changed = [a for a in range(len(shape)) if shape[a] != in_shape[a]]
    if any(state[a] is not None for a in changed):
      raise Ambiguous(f"{eqn.primitive.name} along the batch axis")
    outs.append(p.made(list(state), shape, changed, path + (k,)))
  return outs


def _dynamic_update_slice(p, eqn, ins, path):
  state = []
  for o, u, n, m in zip(ins[0], ins[1], _shape(eqn.invars[0]), _shape(eqn.invars[1])):
    if n == m and n > 1:
      state.append(p.unify([o, u]))
    elif u is None and o is None:
      state.append(None)
    else:
      raise Ambiguous("dynamic_update_slice of a part of the batch axis")
  return [tuple(state)]


def _concatenate(p, eqn, ins, path):
  dim, shape = eqn.params["dimension"], _shape(eqn.outvars[0])
  if any(s[dim] is not None for s in ins):
    raise Ambiguous("concatenate along the batch axis")
  return [tuple(None if a == dim or n == 1 else p.unify([s[a] for s in ins])
                for a, n in enumerate(shape))]


def _scatter(p, eqn, ins, path):
  if any(_scaled(s) for s in ins[1:]):
    raise Ambiguous(f"{eqn.primitive.name} of batched indices or updates")
  return [ins[0]]


def _dot_general(p, eqn, ins, path):
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = ins
  for i, j in zip(lc, rc):
    if _shape(eqn.invars[0])[i] > 1:
      p.unify([lhs[i], rhs[j]])  # A contraction over the batch: the output has none.
  batch = [p.unify([lhs[i], rhs[j]]) if _shape(eqn.invars[0])[i] > 1 else None
           for i, j in zip(lb, rb)]
  free = [s for a, s in enumerate(lhs) if a not in lc and a not in lb]
  free += [s for a, s in enumerate(rhs) if a not in rc and a not in rb]
  return [tuple(batch + free)]


def _conv(p, eqn, ins, path):
  dn = eqn.params["dimension_numbers"]
  lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
  lhs, rhs = ins
  if (_scaled(rhs) or any(lhs[a] is not None for a in lhs_spec[1:])
      or eqn.params.get("batch_group_count", 1) != 1):
    raise Ambiguous("a convolution with the batch outside the input's batch axis")
  state = [None] * len(out_spec)
  state[out_spec[0]] = lhs[lhs_spec[0]]
  return [tuple(state)]


def _gather(p, eqn, ins, path):
  dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
  operand, indices = ins
  in_shape, shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
  collapsed = set(dn.collapsed_slice_dims)
  operand_batching = tuple(getattr(dn, "operand_batching_dims", ()))
  indices_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
  if indices and indices[-1] is not None:
    raise Ambiguous("gather with the batch in the index vector")
  state = [None] * len(shape)
  offset_axes = [a for a in range(len(in_shape))
                 if a not in collapsed and a not in operand_batching]
  made_axes = []
  for o, a in zip(dn.offset_dims, offset_axes):
    if sizes[a] == in_shape[a]:
      state[o] = operand[a]
    elif operand[a] is not None:
      raise Ambiguous("gather of a part of the batch axis")
    else:
      made_axes.append(o)
  batch_positions = [o for o in range(len(shape)) if o not in dn.offset_dims]
  for o, j in zip(batch_positions, range(len(indices) - 1)):
    s = indices[j]
    if j in indices_batching:
      a = operand_batching[indices_batching.index(j)]
      s = p.unify([s, operand[a]]) if in_shape[a] > 1 else s
    state[o] = s
  return [p.made(state, shape, made_axes, path)]


def _split(p, eqn, ins, path):
  """Pieces of an axis sum to its size: pieces of an unscaled axis are unscaled."""
  axis = eqn.params["axis"]
  if ins[0][axis] is not None:
    raise Ambiguous("split along the batch axis")
  return [ins[0]] * len(eqn.outvars)


def _reduce_window(p, eqn, ins, path):
  """Pooling: an axis the window does not touch keeps its batch axis."""
  params = eqn.params
  n = len(params["window_dimensions"])
  untouched = [params["window_dimensions"][a] == 1 and params["window_strides"][a] == 1
               and tuple(params["padding"][a]) == (0, 0)
               and params.get("base_dilation", (1,) * n)[a] == 1 for a in range(n)]
  outs = []
  for state in ins[:len(eqn.outvars)]:
    if any(s is not None and not keep for s, keep in zip(state, untouched)):
      raise Ambiguous("a window over the batch axis")
    outs.append(state)
  return outs


def _bitcast(p, eqn, ins, path):
  """Element-wise between types of one width; another width adds or drops an axis."""
  if _shape(eqn.outvars[0]) == _shape(eqn.invars[0]):
    return _elementwise(p, eqn, ins, path)
  return _unknown(p, eqn, ins, path)


def _while(p, eqn, ins, path):
  """The carry keeps its shapes, so its batch axes, through the loop."""
  n = eqn.params["cond_nconsts"] + eqn.params["body_nconsts"]
  return ins[n:]


def _body(eqn):
  for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    body = eqn.params.get(name)
    body = getattr(body, "jaxpr", body)
    if body is not None and hasattr(body, "eqns") and len(body.invars) == len(eqn.invars):
      return body
  return None


def _call(p, eqn, ins, path):
  """A body the walk looks into (`jit`, `remat`): the same invocation as the walk's."""
  return p.run(_body(eqn), ins, path)


def _opaque_call(p, eqn, ins, path):
  """A body the walk does not look into (custom derivatives): its primal body."""
  body = _body(eqn)
  if body is None or len(body.outvars) != len(eqn.outvars):
    return _unknown(p, eqn, ins, path)
  return p.run(body, ins, path + ("body",))


def _cond(p, eqn, ins, path):
  outs = [p.run(branch.jaxpr, ins[1:], path + (b,))
          for b, branch in enumerate(eqn.params["branches"])]
  return [p.join(branch_states, _shape(v))
          for branch_states, v in zip(zip(*outs), eqn.outvars)]


def _scan(p, eqn, ins, path):
  params = eqn.params
  body = params["jaxpr"].jaxpr
  n_consts, n_carry = params["num_consts"], params["num_carry"]
  consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
  if any(s and s[0] is not None for s in xs):
    raise Ambiguous("a scan over the batch")
  sizes = [_shape(v) for v in eqn.invars[n_consts:n_consts + n_carry]]
  for _ in range(n_carry + 2):  # The carry's batch axes are a fixed point of the body.
    outs = p.run(body, [*consts, *carry, *(s[1:] for s in xs)], path)
    new = [p.join([c, o], shape) for c, o, shape in zip(carry, outs[:n_carry], sizes)]
    if new == carry:
      break
    carry = new
  else:
    raise Ambiguous("a scan carry whose batch axes do not settle")
  length = params["length"]
  ys = []
  for k, s in enumerate(outs[n_carry:]):
    head = p.made([None], (length,), [0], path + ("ys", k)) if not xs else (None,)
    if head[0] is not None and _scaled(s):
      raise Ambiguous("a scan's stacked output with two batch axes")
    ys.append(head + s)
  return carry + ys


def _unknown(p, eqn, ins, path):
  """A primitive without a rule: only of unbatched operands, its outputs' axes made."""
  if any(_scaled(s) for s in ins):
    raise Ambiguous(f"{eqn.primitive.name} takes a batched value")
  return [p.made([None] * len(_shape(v)), _shape(v), range(len(_shape(v))), path + (k,))
          for k, v in enumerate(eqn.outvars)]


_ELEMENTWISE = (
    "abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e "
    "cbrt ceil clamp clz complex conj convert_element_type copy copy_p cos cosh "
    "digamma div eq erf erf_inv erfc exp exp2 expit expm1 floor ge gt igamma igammac imag "
    "integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter "
    "not or polygamma population_count pow real reduce_precision rem round rsqrt "
    "select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt "
    "square stop_gradient sub tan tanh xor zeta threefry2x32 random_fold_in").split()

_RULES: dict[Any, Callable] = {name: _elementwise for name in _ELEMENTWISE}
_RULES.update({name: _identity for name in (
    "optimization_barrier", "device_put", "sharding_constraint", "pvary",
    "mesh_cast", "reshard")})
_RULES.update({name: _reduce for name in (
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin")})
_RULES.update({name: _same_shape for name in (
    "sort", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "rev")})
_RULES.update({name: _resized for name in ("slice", "pad", "dynamic_slice", "top_k")})
_RULES.update({name: _reduce_window for name in (
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")})
_RULES.update({name: _scatter for name in (
    "scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
    "scatter-min", "scatter_min", "scatter-max", "scatter_max")})
_RULES.update({name: _opaque_call for name in (
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")})
_RULES.update({
    "broadcast_in_dim": _broadcast_in_dim, "iota": _iota, "reshape": _reshape,
    "transpose": _transpose, "squeeze": _squeeze, "dot_general": _dot_general,
    "conv_general_dilated": _conv, "gather": _gather, "concatenate": _concatenate,
    "dynamic_update_slice": _dynamic_update_slice, "split": _split,
    "bitcast_convert_type": _bitcast,
    # The primitives the walk keys by object (looked up before the names).
    _internals.jit_p: _call, _internals.closed_call_p: _call, _internals.call_p: _call,
    _internals.remat_p: _call, _internals.cond_p: _cond, _internals.scan_p: _scan,
    _internals.while_p: _while,
    _sites.site_p: _identity, _sites.after_p: _identity,
    _sites.batch_first_p: _identity, _sites.cotangent_p: _identity,
    _internals.sow_p: _identity,
})


def batch_axes(jaxpr, batch_inputs: Sequence[bool], batch_size: int) -> Propagation:
  """Propagates the batch from the leading axis of the inputs marked in
  `batch_inputs`; raises `Ambiguous` where one trace cannot tell."""
  propagation = Propagation(batch_size)
  states = [((DATA,) + (None,) * (len(_shape(v)) - 1)) if is_batch and _shape(v)
            else (None,) * len(_shape(v)) for v, is_batch in zip(jaxpr.invars, batch_inputs)]
  propagation.run(jaxpr, states)
  propagation.check()
  return propagation
