"""Per-example gradients and privacy: ghost norms, DP-SGD clipping, noise, accounting,
and what `record_layers` covers. Internal: the public names are in `oryx_gradlog`."""
