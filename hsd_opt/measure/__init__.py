"""Measurement of decoding, apart from decoding itself (``hsd_opt.runtime``): the ``hsd bench`` harnesses (one
stream, and concurrent clients), the load predictor that prices a served load level, re-timing a profile's costs
at the speed of the moment, and the report tables. Nothing here changes what is decoded."""
