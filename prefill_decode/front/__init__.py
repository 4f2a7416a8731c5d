"""The HTTP fronts: what every front serves (:mod:`.openai`) and the router over upstream engines (:mod:`.upstream`)."""
