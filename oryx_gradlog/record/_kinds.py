"""The layer kinds: one vocabulary for hand-marked layers and found uses.

A layer record, marked by hand (`gl.dense`, `gl.conv2d`, `gl.embed`,
`gl.layer_norm`) or found in a jaxpr by `gl.record_layers`, has one of these kinds;
the analyses, `gl.layer_coverage` and the records' own `kind` attributes use these
strings and nothing else.

Sharp edges:
  * `LAYER_NORM` is a hand-marked kind only: in a jaxpr a layer norm's scale and
    offset are found as two `ELEMENTWISE` uses.
"""

DENSE = "dense"  # A matrix product (dot_general) of the input and a weight.
CONV = "conv"  # A convolution (conv_general_dilated) of the input with a kernel.
EMBED = "embed"  # Rows of a table gathered at integer ids.
LAYER_NORM = "layer_norm"  # A layer norm's scale (and offset), marked by hand.
ELEMENTWISE = "elementwise"  # An element-wise operation with a broadcast parameter.
GENERIC = "generic"  # Any other operation: its vjp per example.
UNSUPPORTED = "unsupported"  # A use that couples examples (the analyses raise).
# The reason of every use when the loss itself mixes examples (batch norm in training).
LOSS_MIXES_EXAMPLES = "the function's output mixes examples"

# The kinds of found uses, in the order `gl.layer_coverage` lists them.
FOUND_KINDS = (DENSE, CONV, EMBED, ELEMENTWISE, GENERIC, UNSUPPORTED)
# The kinds whose per-example norms, clipping and moments the analyses compute.
NORM_KINDS = (DENSE, CONV, EMBED, LAYER_NORM, ELEMENTWISE, GENERIC)
