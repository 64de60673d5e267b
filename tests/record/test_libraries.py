"""Record sites inside Flax (linen and NNX), Equinox and Haiku models, trained with optax.

Each library gets the same small tanh MLP, written the way that library writes it: its
dense layers call `gl.record_vjp` on `(input, kernel, bias)` (Equinox: on the
`eqx.nn.Linear` module itself, a pytree) and its hidden activations pass through
`gl.tap`. A jitted optax step returns the records next to the new state, and at every
step the records must equal what plain JAX computes from that step's parameters with
the perturbation trick (`_reference`). Per-example records come from `vmap` of `grad`.
Linen's lifted transforms (`nn.scan`, `nn.remat`, `nn.vmap`, `nn.jit`), NNX's `nnx.scan` with
`nnx.remat`, and Haiku's `hk.layer_stack` wrap blocks that hold record sites; scanned
and repeated blocks stack their records per iteration, in forward order.
"""

import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close

import oryx_gradlog as gl

optax = pytest.importorskip("optax")
nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
hk = pytest.importorskip("haiku")

SIZES = (3, 5, 4, 2)  # input, hidden, hidden, output
DEPTH = 3  # blocks in the stacked models
BATCH, STEPS, LR = 4, 3, 3e-2
RTOL, ATOL = 1e-5, 1e-6
MLP_DEPTH = len(SIZES) - 1


def _data():
  kx, kt = jax.random.split(jax.random.PRNGKey(0))
  return (jax.random.normal(kx, (BATCH, SIZES[0])),
          jax.random.normal(kt, (BATCH, SIZES[-1])))


def _affine(x, kernel, bias):
  return x @ kernel + bias


def _mse(y, t):
  """Mean over the batch of the squared error; one example's squared error if 1-D."""
  return jnp.mean(jnp.sum((y - t) ** 2, axis=-1))


def _reference(layers, x, t):
  """What the records of a tanh MLP must be, computed with plain JAX.

  True computation: a zero `delta` is added to each layer's inputs (input, kernel,
  bias), to its output and, for hidden layers, to its activation; the gradient with
  respect to the deltas is each value's cotangent.

  Args:
    layers: `[(kernel, bias), ...]`, tanh after every layer but the last.
    x: the inputs, `(batch, in)` or one example `(in,)`.
    t: the targets.

  Returns:
    A dict: `layer{i}` -> (dL/dx, dL/dkernel, dL/dbias) of layer i's affine map,
    `pre{i}` -> dL/dy of its output, `act{i}` -> dL/dh of its tanh activation.
  """
  zeros, h = {}, x
  for i, (kernel, bias) in enumerate(layers):
    zeros[f"layer{i}"] = (jnp.zeros_like(h), jnp.zeros_like(kernel), jnp.zeros_like(bias))
    h = jnp.tanh(_affine(h, kernel, bias))
    zeros[f"pre{i}"] = zeros[f"act{i}"] = jnp.zeros_like(h)

  def perturbed(deltas):
    h = x
    for i, (kernel, bias) in enumerate(layers):
      dx, dkernel, dbias = deltas[f"layer{i}"]
      h = _affine(h + dx, kernel + dkernel, bias + dbias) + deltas[f"pre{i}"]
      if i < len(layers) - 1:
        h = jnp.tanh(h) + deltas[f"act{i}"]
    return _mse(h, t)

  expected = jax.grad(perturbed)(zeros)
  del expected[f"act{len(layers) - 1}"]  # The output layer has no activation.
  return expected


def _per_example_reference(layers, x, t):
  return jax.vmap(_reference, in_axes=(None, 0, 0))(layers, x, t)


def _mlp_records(expected, depth=MLP_DEPTH):
  """The part of `_reference` that the MLPs record: layers and hidden activations."""
  names = [f"layer{i}" for i in range(depth)] + [f"act{i}" for i in range(depth - 1)]
  return {name: expected[name] for name in names}


def _stack(trees):
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _stacked_records(expected, depth=DEPTH):
  """`_reference` of `depth` tanh blocks and a head, as stacked models record it."""
  return {
      "act": _stack([expected[f"act{i}"] for i in range(depth)]),
      "head": expected[f"layer{depth}"],
      "layer": _stack([expected[f"layer{i}"] for i in range(depth)]),
  }


def _train_and_check(step, state, layers_of, expected_of, x, t, steps=STEPS):
  """Runs a jitted `step(state, x, t) -> (state, records)` `steps` times and checks
  each step's records against `expected_of(layers_of(state), x, t)`, where `state` is
  the state that step started from."""
  first = layers_of(state)
  for _ in range(steps):
    layers = layers_of(state)
    state, records = step(state, x, t)
    expected = expected_of(layers, x, t)
    assert sorted(records) == sorted(expected)
    assert_trees_close(records, expected, rtol=RTOL, atol=ATOL)
  # The parameters did train, so the steps checked different records.
  assert not np.allclose(layers_of(state)[0][0], first[0][0])


class _Counter:
  """Counts how often a function is traced (its Python body runs)."""

  def __init__(self):
    self.traces = 0

  def __call__(self, f):
    def counted(*args):
      self.traces += 1
      return f(*args)
    return counted


def _optax_step(loss, optimizer, counter):
  """A jitted optax step on `(params, opt_state)` that also returns the records."""
  @jax.jit
  @counter
  def step(state, x, t):
    params, opt_state = state
    grads, records = gl.call_and_reap(jax.grad(loss))(params, x, t)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), records
  return step


# Flax linen.


class LinenDense(nn.Module):
  """A dense layer that records its affine map under the module's name."""

  features: int
  full: bool = False

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.lecun_normal(),
                        (x.shape[-1], self.features))
    bias = self.param("bias", nn.initializers.normal(0.1), (self.features,))
    return gl.record_vjp(_affine, name=self.name, full=self.full)(x, kernel, bias)


class LinenMLP(nn.Module):
  sizes: tuple = SIZES
  full: bool = False

  @nn.compact
  def __call__(self, x):
    for i, features in enumerate(self.sizes[1:]):
      x = LinenDense(features, full=self.full, name=f"layer{i}")(x)
      if i < len(self.sizes) - 2:
        x = gl.tap(jnp.tanh(x), name=f"act{i}")
    return x


class LinenBlock(nn.Module):
  """A tanh block for stacking; every copy records under the same names."""

  @nn.compact
  def __call__(self, h, _=None):
    h = gl.tap(jnp.tanh(LinenDense(h.shape[-1], name="layer")(h)), name="act")
    return h, None


class LinenStack(nn.Module):
  """`DEPTH` blocks lifted by `nn.scan`, `nn.remat`, both, or `nn.jit`, then a head."""

  lift: str

  @nn.compact
  def __call__(self, x):
    block = nn.remat(LinenBlock) if "remat" in self.lift else LinenBlock
    block = nn.jit(block) if self.lift == "jit" else block
    if "scan" in self.lift:
      scanned = nn.scan(block, variable_axes={"params": 0},
                        split_rngs={"params": True}, length=DEPTH)
      x, _ = scanned(name="blocks")(x, None)
    else:
      for i in range(DEPTH):
        x, _ = block(name=f"blocks_{i}")(x)
    return LinenDense(SIZES[-1], name="head")(x)


def _linen_layers(params, depth=MLP_DEPTH):
  return [(params["params"][f"layer{i}"]["kernel"], params["params"][f"layer{i}"]["bias"])
          for i in range(depth)]


def _linen_stack_layers(params, lift):
  p = params["params"]
  if "scan" in lift:
    kernels, biases = p["blocks"]["layer"]["kernel"], p["blocks"]["layer"]["bias"]
    blocks = [(kernels[i], biases[i]) for i in range(DEPTH)]
  else:
    blocks = [(p[f"blocks_{i}"]["layer"]["kernel"], p[f"blocks_{i}"]["layer"]["bias"])
              for i in range(DEPTH)]
  return blocks + [(p["head"]["kernel"], p["head"]["bias"])]


def test_linen_mlp_trains_with_records_equal_to_the_reference():
  x, t = _data()
  model = LinenMLP()
  params = model.init(jax.random.PRNGKey(1), x)
  loss = lambda params, x, t: _mse(model.apply(params, x), t)
  optimizer, counter = optax.adam(LR), _Counter()
  step = _optax_step(loss, optimizer, counter)
  _train_and_check(step, (params, optimizer.init(params)), lambda s: _linen_layers(s[0]),
                   lambda layers, x, t: _mlp_records(_reference(layers, x, t)), x, t)
  assert counter.traces == 1


def test_linen_full_records_hold_primals_and_output_cotangents():
  x, t = _data()
  model = LinenMLP(full=True)
  params = model.init(jax.random.PRNGKey(1), x)
  loss = lambda params, x, t: _mse(model.apply(params, x), t)
  records = jax.jit(gl.reap(jax.grad(loss)))(params, x, t)

  layers = _linen_layers(params)
  expected = _reference(layers, x, t)
  h = x
  for i, (kernel, bias) in enumerate(layers):
    record = records[f"layer{i}"]
    assert isinstance(record, gl.VJPRecord)
    assert_trees_close(record.primals, (h, kernel, bias))
    assert_trees_close(record.out_cotangent, expected[f"pre{i}"], rtol=RTOL, atol=ATOL)
    assert_trees_close(record.in_cotangents, expected[f"layer{i}"], rtol=RTOL, atol=ATOL)
    h = jnp.tanh(_affine(h, kernel, bias))


def test_linen_per_example_records_with_vmap_of_grad():
  x, t = _data()
  model = LinenMLP()
  params = model.init(jax.random.PRNGKey(1), x)
  loss = lambda params, x, t: _mse(model.apply(params, x), t)
  records = jax.jit(gl.reap(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))))(params, x, t)
  assert records["layer0"][1].shape == (BATCH, SIZES[0], SIZES[1])
  expected = _mlp_records(_per_example_reference(_linen_layers(params), x, t))
  assert_trees_close(records, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("lift", ["scan", "remat", "scan_of_remat", "jit"])
def test_linen_lifted_scan_remat_and_jit_stack_blocks_in_forward_order(lift):
  x, t = _data()
  model = LinenStack(lift)
  params = model.init(jax.random.PRNGKey(2), x)
  loss = lambda params, x, t: _mse(model.apply(params, x), t)
  optimizer = optax.sgd(LR)
  step = _optax_step(loss, optimizer, _Counter())
  _train_and_check(
      step, (params, optimizer.init(params)), lambda s: _linen_stack_layers(s[0], lift),
      lambda layers, x, t: _stacked_records(_reference(layers, x, t)), x, t)


def test_linen_lifted_scan_under_per_example_vmap_gives_blocks_then_examples():
  x, t = _data()
  model = LinenStack("scan")
  params = model.init(jax.random.PRNGKey(2), x)
  loss = lambda params, x, t: _mse(model.apply(params, x), t)
  records = jax.jit(gl.reap(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))))(params, x, t)
  # Iterations first, then examples: (DEPTH, BATCH, ...).
  assert records["layer"][1].shape == (DEPTH, BATCH, SIZES[0], SIZES[0])
  expected = _stacked_records(
      _per_example_reference(_linen_stack_layers(params, "scan"), x, t))
  assert_trees_close(records, expected, rtol=RTOL, atol=ATOL)


def test_linen_lifted_vmap_ensemble_records_per_member():
  # nn.vmap with per-member parameters: an ensemble of MLPs on the same batch. The
  # gradient is taken outside nn.vmap, i.e. grad(vmap(f)): what varies by member
  # (parameters, hidden values) is recorded per member, while the batch `x` that all
  # members share gets one cotangent, summed over the members (README "Sharp edges").
  members = 3
  x, t = _data()
  model = nn.vmap(LinenMLP, variable_axes={"params": 0}, split_rngs={"params": True},
                  in_axes=None, out_axes=0, axis_size=members)()
  params = model.init(jax.random.PRNGKey(3), x)
  loss = lambda params, x, t: jnp.sum(jax.vmap(_mse, (0, None))(model.apply(params, x), t))
  optimizer = optax.adam(LR)
  step = _optax_step(loss, optimizer, _Counter())

  def expected_of(layers, x, t):
    member = lambda layers: _mlp_records(_reference(layers, x, t))
    expected = jax.vmap(member)(layers)  # (member, ...)
    ct_x, ct_kernel, ct_bias = expected["layer0"]
    expected["layer0"] = (ct_x.sum(0), ct_kernel, ct_bias)  # Shared by the members.
    return expected

  _train_and_check(step, (params, optimizer.init(params)), lambda s: _linen_layers(s[0]),
                   expected_of, x, t)


def test_linen_lifted_vmap_over_examples_sums_shared_parameter_cotangents():
  # nn.vmap over the batch with shared parameters is grad(vmap(f)): the inputs' and
  # activations' records are per example, the shared kernel's is summed over the batch
  # (README "Sharp edges"), so they equal the batched reference.
  x, t = _data()
  model = nn.vmap(LinenMLP, variable_axes={"params": None}, split_rngs={"params": False},
                  in_axes=0, out_axes=0)()
  params = model.init(jax.random.PRNGKey(3), x)
  loss = lambda params, x, t: _mse(model.apply(params, x), t)
  records = jax.jit(gl.reap(jax.grad(loss)))(params, x, t)
  assert records["layer0"][0].shape == (BATCH, SIZES[0])
  assert records["layer0"][1].shape == (SIZES[0], SIZES[1])
  expected = _mlp_records(_reference(_linen_layers(params), x, t))
  assert_trees_close(records, expected, rtol=RTOL, atol=ATOL)


# Flax NNX.


class NNXDense(nnx.Module):
  """An `nnx.Linear` whose affine map is recorded as `name`."""

  def __init__(self, din, dout, *, name, rngs):
    self.linear = nnx.Linear(din, dout, bias_init=nnx.initializers.normal(0.1), rngs=rngs)
    self.name = name

  def __call__(self, x):
    linear = self.linear
    return gl.record_vjp(_affine, name=self.name)(x, linear.kernel[...], linear.bias[...])


# Flax NNX 0.12 holds a list of modules in an `nnx.List`; older NNX in a list.
_NNXList = getattr(nnx, "List", list)


class NNXMLP(nnx.Module):

  def __init__(self, sizes, *, rngs):
    self.layers = _NNXList([NNXDense(din, dout, name=f"layer{i}", rngs=rngs)
                            for i, (din, dout) in enumerate(itertools.pairwise(sizes))])

  def __call__(self, x):
    for i, layer in enumerate(self.layers):
      x = layer(x)
      if i < len(self.layers) - 1:
        x = gl.tap(jnp.tanh(x), name=f"act{i}")
    return x


class NNXStack(nnx.Module):
  """`DEPTH` tanh blocks created by `nnx.vmap` and run by `nnx.scan` of `nnx.remat`."""

  def __init__(self, width, dout, *, rngs):
    @nnx.split_rngs(splits=DEPTH)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return NNXDense(width, width, name="layer", rngs=rngs)

    self.blocks = blocks(rngs)
    self.head = NNXDense(width, dout, name="head", rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def run(h, block):
      return gl.tap(jnp.tanh(block(h)), name="act")

    return self.head(run(x, self.blocks))


def _nnx_layers(layers):
  return [(layer.linear.kernel[...], layer.linear.bias[...]) for layer in layers]


def _nnx_train_and_check(model, expected_of, layers_of, x, t):
  optimizer, counter = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param), _Counter()
  loss = lambda model, x, t: _mse(model(x), t)

  @nnx.jit
  @counter
  def nnx_step(model, optimizer, x, t):
    grads, records = gl.call_and_reap(nnx.grad(loss))(model, x, t)
    # Flax NNX 0.11 added the model to `Optimizer.update`.
    if "model" in inspect.signature(optimizer.update).parameters:
      optimizer.update(model, grads)
    else:
      optimizer.update(grads)
    return records

  def step(state, x, t):
    return state, nnx_step(*state, x, t)

  _train_and_check(step, (model, optimizer), lambda s: layers_of(s[0]), expected_of, x, t)
  assert counter.traces == 1


def test_nnx_mlp_trains_with_records_equal_to_the_reference():
  x, t = _data()
  _nnx_train_and_check(
      NNXMLP(SIZES, rngs=nnx.Rngs(4)),
      lambda layers, x, t: _mlp_records(_reference(layers, x, t)),
      lambda model: _nnx_layers(model.layers), x, t)


def test_nnx_per_example_records_with_nnx_vmap_of_nnx_grad():
  x, t = _data()
  model = NNXMLP(SIZES, rngs=nnx.Rngs(4))
  loss = lambda model, x, t: _mse(model(x), t)
  per_example = nnx.jit(gl.reap(nnx.vmap(nnx.grad(loss), in_axes=(None, 0, 0))))
  records = per_example(model, x, t)
  expected = _mlp_records(_per_example_reference(_nnx_layers(model.layers), x, t))
  assert_trees_close(records, expected, rtol=RTOL, atol=ATOL)


def test_nnx_scan_of_remat_stacks_blocks_in_forward_order():
  x, t = _data()

  def layers_of(model):
    kernels, biases = model.blocks.linear.kernel[...], model.blocks.linear.bias[...]
    return [(kernels[i], biases[i]) for i in range(DEPTH)] + _nnx_layers([model.head])

  _nnx_train_and_check(
      NNXStack(SIZES[0], SIZES[-1], rngs=nnx.Rngs(5)),
      lambda layers, x, t: _stacked_records(_reference(layers, x, t)), layers_of, x, t)


def test_nnx_state_changed_inside_a_reap_reaches_the_callers_module():
  class Net(nnx.Module):

    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 4, rngs=rngs)
      self.norm = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
      return gl.tap(self.norm(self.linear(x)), name="h")

  loss = lambda model, x: jnp.sum(model(x) ** 2)
  x = jax.random.normal(jax.random.key(0), (8, 3))
  reaped, plain = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
  h = Net(nnx.Rngs(0))(x)  # Training mode: batch statistics, as in the steps below.
  grads, records = nnx.jit(lambda m, x: gl.call_and_reap(nnx.grad(loss))(m, x))(reaped, x)
  expected = nnx.jit(nnx.grad(loss))(plain, x)
  assert_trees_close(grads, expected, rtol=1e-5, atol=1e-6)
  assert_trees_close(records["h"], 2 * h, rtol=1e-5, atol=1e-6)  # dL/dh of sum(h**2).
  # The running statistics the forward pass updated reach the caller's module.
  assert_trees_close(nnx.state(reaped, nnx.BatchStat), nnx.state(plain, nnx.BatchStat))
  (mean,) = jax.tree.leaves(nnx.state(reaped, nnx.BatchStat)["norm"]["mean"])
  assert not np.allclose(mean, 0)


def test_stock_nnx_linear_with_dense_dot_general_gives_per_example_norms():
  # Stock modules: nnx.Linear computes as always; its product is a dense-layer record.
  rngs = nnx.Rngs(1)
  layers = [nnx.Linear(4, 5, dot_general=gl.dense_dot_general(name="fc1"), rngs=rngs),
            nnx.Linear(5, 3, dot_general=gl.dense_dot_general(name="fc2"), rngs=rngs)]
  x, t = jax.random.normal(jax.random.key(2), (6, 4)), jax.random.normal(jax.random.key(3), (6, 3))

  def loss(layers, x, t):
    return jnp.mean(jnp.sum((layers[1](jnp.tanh(layers[0](x))) - t) ** 2, -1))

  records = nnx.jit(lambda m, x, t: gl.reap(nnx.grad(loss))(m, x, t))(layers, x, t)
  # True computation: per-example gradients of the module's parameters.
  graphdef, state = nnx.split(layers)
  per_example = jax.vmap(jax.grad(lambda p, x, t: loss(nnx.merge(graphdef, p), x[None], t[None])),
                         in_axes=(None, 0, 0))(state, x, t)
  squares = sum(jnp.sum(g.reshape(6, -1) ** 2, 1) for g in jax.tree.leaves(per_example))
  np.testing.assert_allclose(gl.per_example_norms(records).norms, jnp.sqrt(squares), rtol=1e-5)
  with pytest.raises(ValueError, match=r"dense_dot_general\(name='fc'\): got out_sharding=.*"
                     r"jax.lax.with_sharding_constraint"):
    gl.dense_dot_general(name="fc")(x, jnp.ones((4, 2)), (((1,), (0,)), ((), ())),
                                    out_sharding=jax.sharding.PartitionSpec())


# Equinox.


def _call(module, x):
  return module(x)


class EqxMLP(eqx.Module):
  """Equinox MLP on one example; each `eqx.nn.Linear` is recorded with its input."""

  layers: list

  def __init__(self, sizes, key):
    keys = jax.random.split(key, len(sizes) - 1)
    self.layers = [eqx.nn.Linear(din, dout, key=k)
                   for (din, dout), k in zip(itertools.pairwise(sizes), keys)]

  def __call__(self, x):
    for i, layer in enumerate(self.layers):
      # The module is a pytree: its record is an eqx.nn.Linear of cotangents.
      x = gl.record_vjp(_call, name=f"layer{i}")(layer, x)
      if i < len(self.layers) - 1:
        x = gl.tap(jnp.tanh(x), name=f"act{i}")
    return x


def _eqx_layers(model):
  return [(layer.weight.T, layer.bias) for layer in model.layers]


def _eqx_layout(records, depth=MLP_DEPTH):
  """Equinox records in the reference's layout: (dL/dx, dL/dkernel, dL/dbias)."""
  out = dict(records)
  for i in range(depth):
    linear, ct_x = records[f"layer{i}"]
    out[f"layer{i}"] = (ct_x, jnp.swapaxes(linear.weight, -1, -2), linear.bias)
  return out


def _eqx_batch_loss(model, x, t):
  return _mse(jax.vmap(model)(x), t)


def test_equinox_mlp_trains_with_records_equal_to_the_reference():
  x, t = _data()
  model = EqxMLP(SIZES, jax.random.PRNGKey(6))
  optimizer, counter = optax.adam(LR), _Counter()

  @eqx.filter_jit
  @counter
  def eqx_step(model, opt_state, x, t):
    grads, records = gl.call_and_reap(eqx.filter_grad(_eqx_batch_loss))(model, x, t)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return (eqx.apply_updates(model, updates), opt_state), _eqx_layout(records)

  state = (model, optimizer.init(eqx.filter(model, eqx.is_array)))
  _train_and_check(lambda state, x, t: eqx_step(*state, x, t), state,
                   lambda s: _eqx_layers(s[0]),
                   lambda layers, x, t: _mlp_records(_reference(layers, x, t)), x, t)
  assert counter.traces == 1


def test_equinox_per_example_records_with_filter_vmap_of_filter_grad():
  x, t = _data()
  model = EqxMLP(SIZES, jax.random.PRNGKey(6))
  example_loss = lambda model, x, t: _mse(model(x), t)

  # (A def rather than filter_jit(gl.reap(...)): filter_jit warns about any callable
  # whose `__wrapped__` chain holds ints, such as filter_vmap's in_axes.)
  @eqx.filter_jit
  def per_example(model, x, t):
    return gl.reap(eqx.filter_vmap(eqx.filter_grad(example_loss), in_axes=(None, 0, 0)))(
        model, x, t)

  records = per_example(model, x, t)
  linear, _ = records["layer0"]
  assert isinstance(linear, eqx.nn.Linear) and linear.weight.shape == (BATCH, 5, 3)
  expected = _mlp_records(_per_example_reference(_eqx_layers(model), x, t))
  assert_trees_close(_eqx_layout(records), expected, rtol=RTOL, atol=ATOL)


def test_equinox_scan_over_stacked_layers():
  x, t = _data()
  keys = jax.random.split(jax.random.PRNGKey(7), DEPTH + 1)
  blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(SIZES[0], SIZES[0], key=k))(keys[:DEPTH])
  head = eqx.nn.Linear(SIZES[0], SIZES[-1], key=keys[-1])
  dynamic, static = eqx.partition(blocks, eqx.is_array)

  def example_loss(model, x, t):
    dynamic, head = model

    def body(h, block):
      block = eqx.combine(block, static)
      return gl.tap(jnp.tanh(gl.record_vjp(_call, name="layer")(block, h)), name="act"), None

    h, _ = jax.lax.scan(body, x, dynamic)
    return _mse(gl.record_vjp(_call, name="head")(head, h), t)

  per_example = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))
  records = jax.jit(gl.reap(per_example))((dynamic, head), x, t)

  layers = [(blocks.weight[i].T, blocks.bias[i]) for i in range(DEPTH)]
  layers.append((head.weight.T, head.bias))
  expected = _stacked_records(_per_example_reference(layers, x, t))
  (block_ct, ct_x), (head_ct, ct_h) = records["layer"], records["head"]
  assert_trees_close(
      {"act": records["act"],
       "head": (ct_h, jnp.swapaxes(head_ct.weight, -1, -2), head_ct.bias),
       "layer": (ct_x, jnp.swapaxes(block_ct.weight, -1, -2), block_ct.bias)},
      expected, rtol=RTOL, atol=ATOL)


# Haiku.


class HkDense(hk.Module):
  """A Haiku dense layer that records its affine map under the module's name."""

  def __init__(self, features, name):
    super().__init__(name=name)
    self.features = features

  def __call__(self, x):
    kernel = hk.get_parameter("w", (x.shape[-1], self.features), x.dtype,
                              init=hk.initializers.VarianceScaling())
    bias = hk.get_parameter("b", (self.features,), x.dtype,
                            init=hk.initializers.RandomNormal(0.1))
    return gl.record_vjp(_affine, name=self.name)(x, kernel, bias)


def _hk_mlp(x, sizes=SIZES):
  for i, features in enumerate(sizes[1:]):
    x = HkDense(features, name=f"layer{i}")(x)
    if i < len(sizes) - 2:
      x = gl.tap(jnp.tanh(x), name=f"act{i}")
  return x


def _hk_stack(x):
  def block(h):
    return gl.tap(jnp.tanh(HkDense(h.shape[-1], name="layer")(h)), name="act")

  return HkDense(SIZES[-1], name="head")(hk.layer_stack(DEPTH)(block)(x))


def _hk_layers(params, depth=MLP_DEPTH):
  return [(params[f"layer{i}"]["w"], params[f"layer{i}"]["b"]) for i in range(depth)]


def test_haiku_mlp_trains_with_records_equal_to_the_reference():
  x, t = _data()
  net = hk.without_apply_rng(hk.transform(_hk_mlp))
  params = net.init(jax.random.PRNGKey(8), x)
  loss = lambda params, x, t: _mse(net.apply(params, x), t)
  optimizer, counter = optax.adam(LR), _Counter()
  step = _optax_step(loss, optimizer, counter)
  _train_and_check(step, (params, optimizer.init(params)), lambda s: _hk_layers(s[0]),
                   lambda layers, x, t: _mlp_records(_reference(layers, x, t)), x, t)
  assert counter.traces == 1


def test_haiku_per_example_records_with_vmap_of_grad():
  x, t = _data()
  net = hk.without_apply_rng(hk.transform(_hk_mlp))
  params = net.init(jax.random.PRNGKey(8), x)
  loss = lambda params, x, t: _mse(net.apply(params, x), t)
  records = jax.jit(gl.reap(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))))(params, x, t)
  expected = _mlp_records(_per_example_reference(_hk_layers(params), x, t))
  assert_trees_close(records, expected, rtol=RTOL, atol=ATOL)


def test_haiku_layer_stack_stacks_blocks_in_forward_order():
  x, t = _data()
  net = hk.without_apply_rng(hk.transform(_hk_stack))
  params = net.init(jax.random.PRNGKey(9), x)
  loss = lambda params, x, t: _mse(net.apply(params, x), t)
  optimizer = optax.sgd(LR)
  step = _optax_step(loss, optimizer, _Counter())

  def layers_of(state):
    params = state[0]
    (stacked,) = [p for name, p in params.items() if name != "head"]
    return [(stacked["w"][i], stacked["b"][i]) for i in range(DEPTH)] + [
        (params["head"]["w"], params["head"]["b"])]

  _train_and_check(step, (params, optimizer.init(params)), layers_of,
                   lambda layers, x, t: _stacked_records(_reference(layers, x, t)), x, t)
