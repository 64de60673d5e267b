"""Training instruments (Cockpit's): batch-size tests, GSNR, alpha, update size,
histograms, the gradient noise scale, and the optax-style transform that reads them.
Internal: the public names are in `oryx_gradlog`."""
