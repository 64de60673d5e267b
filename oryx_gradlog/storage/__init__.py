"""Storage and reports: the on-disk run log, its HTML report and TensorBoard export.

Internal: the public names are in `oryx_gradlog`.
"""
