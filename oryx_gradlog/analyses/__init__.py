"""Analyses from one backward pass: per-example norms, curvature factors, gradient
noise, non-finite values, and DP-SGD's clipped gradients, noise and accounting.

Internal: the public names are in `oryx_gradlog`.
"""
