"""Record sites and reaping: the JAX primitives that mark values, Oryx's harvest that
collects their cotangents, the layer helpers, and every JAX and Oryx internal.

The data path of a layer record: `_layers.py` (hand-marked helpers) or
`record_layers/` (uses found in a jaxpr, of the kinds in `kinds/`) make it;
`_reap.py` collects it; `_selection.py` reads it for the analyses as a layer use
(`_marked.py` or `_found.py`), in the canonical form of `_canonical.py`.

Internal: the public names are in `oryx_gradlog`.
"""
