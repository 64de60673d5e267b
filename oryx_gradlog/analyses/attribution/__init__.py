"""Training-data attribution: influence functions from the layer records.
Internal: the public names are in `oryx_gradlog`."""
