"""Debugging the backward pass: where the first non-finite cotangent was made.
Internal: the public names are in `oryx_gradlog`."""
