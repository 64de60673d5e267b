"""Training-data attribution: which training examples did this.

* `_blocks.py`: the blocks (a layer's weight with its bias, or one parameter) and
  what one batch's records give each;
* `_factors.py`: the curvature of influence functions, block by block (K-FAC,
  EK-FAC, the full Fisher, none: plain gradient products), `InfluenceFactors`;
* `_influence.py`: influence functions (`fit_influence`, `Influence`): scores,
  self-influence, the most helpful and harmful examples;
* `_low_rank.py`: queries' preconditioned gradients as low-rank factors, scored
  from the training examples' records (`Influence.scores(query_rank=...)`);
* `_projection.py`: LoGra's projected per-example gradients (`fit_projector`,
  `projected_grads`), small enough to log at every training step;
* `_from_run.py`: from such a log, TracIn, influence and the examples behind a
  loss spike;
* `_optimizers.py`: the step directions of optimisers other than SGD (Adam's
  preconditioner), for TracIn;
* `_lds.py`: the linear datamodeling score of any attribution.

Internal: the public names are in `oryx_gradlog`.
"""
