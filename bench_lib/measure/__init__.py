"""INSTRUMENTS: code that touches a clock or a device and writes no file.

``timing`` (the whole timing rule), ``stats``, ``sampler``, ``flops``, ``memory``, ``trace``
(the pipeline timeline's hooks) and ``environment`` (what env.json records).
"""
