"""Analyses of the records of one backward pass, grouped by concern:

* `per_example`: per-example norms, products with a direction, DP-SGD's clipped
  gradients, noise and accounting, and the coverage report of `record_layers`;
* `curvature`: K-FAC factors, second moments of per-example gradients, Hessian
  products;
* `instruments`: Cockpit's training instruments and the gradient noise scale;
* `debugging`: where a non-finite value entered the backward pass;
* `attribution`: influence functions (which training examples did this), LoGra's
  projected per-example gradients, TracIn and loss-spike attribution from a logged
  run, and the linear datamodeling score.

Each starts with `_common.select`, which reads the records as one `Selection` of
layer uses (`oryx_gradlog.record._selection`), hand-marked and found alike, and loops
once over its keys or uses. Internal: the public names are in `oryx_gradlog`.
"""
