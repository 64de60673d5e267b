"""Statistics of records computed on the device: summaries, running statistics and
moving averages.

Internal: the public names are in `oryx_gradlog`.
"""
