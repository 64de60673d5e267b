"""Record sites and reaping: the JAX primitives that mark values, Oryx's harvest that
collects their cotangents, the layer helpers, and every JAX and Oryx internal.

Internal: the public names are in `oryx_gradlog`.
"""
