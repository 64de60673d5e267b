"""Layer records found in a model's jaxpr: `record_layers`, for any JAX model as it is.

The analyses need, for every parameter, where it meets the batch: the operation that
takes the parameter (or a function of parameters alone) and a value with a batch
axis, its other operands, and the cotangent of its output. `record_layers(fun)`
finds these *uses* in the traced jaxpr of `fun` instead of asking the user to mark
layers:

1. `fun` is traced to a jaxpr (`jax.make_jaxpr`) at the batch size B of the call.
   JAX has no notion of a batch axis: its batch axes are the axes that would double
   at 2B, of size `B * k` (k > 1: the batch merged with positions, accepted only
   where a reshape keeps the batch the outer factor). They are propagated from the
   batch arguments' leading axes through the equations (`_propagate.py`), and
   where that cannot tell (a value made with two axes of the batch's size, ...),
   `fun` is traced once more at 2B and the axes that double are the batch's: the
   question shape polymorphism answers, without its restrictions.
2. One small interpreter walks the jaxpr (in lockstep with the one at 2B, where
   there is one), with one rule per kind of
   equation kept in a table (`_RULES`), recursing into the bodies of `jit`, `scan`,
   `cond` and `remat` through the same table. Each value is classified: parameter
   (depends on parameters only), data (depends on the batch), or constant. A value
   of parameters alone has a *lineage* back to its parameter leaf: reshapes,
   transposes, casts, slices of a stacked parameter in a `scan` over layers, or, for
   any other function of parameters alone (weight normalisation, LoRA's `A @ B`), a
   *chain* of equations that the analyses differentiate.
3. An equation with a parameter operand and a batched output is a use. Its kind says
   what the analyses can do with it: `dot_general` (dense layers, attention's 3-D
   kernels, `einsum`, a tied output projection), `conv_general_dilated`, a row
   `gather` (embeddings), an element-wise operation with a broadcast parameter
   (biases, norm scales and offsets, learned position embeddings), and any other
   operation (generic: its per-example gradient is the vector-Jacobian product of
   that one operation, per example).
4. The jaxpr is evaluated again, equation by equation under whatever
   transformations are active (`grad`, `jit`, `vmap`, the reap), with each use's
   output marked by one record site (a dense or convolution use whose output only
   its bias reads shares the bias's site, whose cotangent is also its own), so that a
   reap collects a `VJPRecord` per use whose `primals[0]` is a `LayerUse` (the
   operands, the inputs of its chain, and a static `UseSpec` describing the use) and
   whose `out_cotangent` is the cotangent of its output; `in_cotangents` is `None`
   unless asked for
   (`record_layers(..., in_cotangents=True)` wraps each use in
   `record_vjp(..., full=True)`, two sites). Everything else is bound as traced, so
   the function computes what `fun` computes.

Record names are parameter paths (`blocks.0.attn.query.kernel`), with `@2`, `@3`,
... for further uses of one parameter (a tied embedding's output projection) and
`+` joining the paths of a use that combines several parameters (LoRA).

Sharp edges:
  * `fun` is traced once per input signature, or twice (B and 2B) where one trace
    cannot tell its batch axes; then code whose structure depends on the batch size
    is an error. Traces are cached per shapes and dtypes.
  * The batch is the leading axis of every leaf of the batch arguments (default:
    every positional argument not in `argnums`); all must have the same size.
  * A parameter that meets data with no batch axis (a weight-decay term added to
    the batch loss, batch-norm statistics), or whose use couples examples (a value
    reduced over the batch, or an axis that mixes examples), gets an
    `unsupported` record: the per-example analyses raise for it, naming the
    parameter and the operation; `gl.layer_coverage` lists it before training.
  * A function of parameters computed outside the `scan`, `cond` or `remat` that
    uses it must be a view (reshape, transpose, cast, ...) to cross into the body;
    other functions are `unsupported` there (compute them inside the body).
  * `custom_jvp`/`custom_vjp` functions, `while_loop`s and other primitives with
    bodies are not looked into: a parameter entering one with a batched output is a
    generic use of the whole call.
  * A layer marked by hand (`gl.dense`, `gl.conv2d`, `gl.embed`, `gl.layer_norm`,
    `gl.dense_dot_general`) with the same tag is recorded once, as the uses found
    in it, keyed by parameter path (not a second time by its name), as kfac-jax's
    `register_dense` and its graph matcher give one tag. Its declared kind is not
    needed: the walk finds the same operations.
  * The jaxpr is re-emitted with inner `jit`s inlined where they hold uses (as any
    outer transformation does; their shardings are not kept).
  * A use whose output reaches the loss only through `stop_gradient` (a target
    computed from the same weights, labels sampled from the model) gets a zero
    cotangent and is not recorded, where it is outside any inner `jit`, `scan` or
    other call of the loss; inside one, it is recorded (with zeros) and counts as a
    use of its parameters.

The package, one concept a module: `_spec.py` (what a record says about its use),
`_propagate.py` (batch axes from one trace), `_walk.py` (the classifying interpreter
and its rule table), `_emit.py` (the jaxpr
evaluated again with the uses recorded), `_signature.py` (the call's parameters and
batch), `_transform.py` (`record_layers` itself). The kinds of use are in
`oryx_gradlog/record/kinds/`: adding one is one module there and one table entry.
"""

from oryx_gradlog.record._kinds import FOUND_KINDS as KINDS
from oryx_gradlog.record.record_layers._signature import Signature, path_name
from oryx_gradlog.record.record_layers._spec import (
    Chain, LayerUse, Lineage, ParamTree, Step, UseSpec)
from oryx_gradlog.record.record_layers._transform import record_layers, recorder, trace


__all__ = ("Chain", "KINDS", "LayerUse", "Lineage", "ParamTree", "Signature", "Step",
           "UseSpec", "path_name", "record_layers", "recorder", "trace")
