"""Curvature and second moments: K-FAC factors, SumGradSquared and variance, Hessian
trace, diagonal and top eigenvalue. Internal: the public names are in `oryx_gradlog`."""
