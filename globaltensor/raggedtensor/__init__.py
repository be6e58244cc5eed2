"""Ragged tensors: a Split whose per-rank sizes are data (`gt.ragged(d)`), the layout of tokens routed to
experts. `tensor` is the class and its conversions, `cuts` the sizes' arithmetic, `run` the op path (its
general rule path `rules` decided by the one dispatcher, a reshape's rows `views`), `ops` the user's
construction, `grouped` the experts' grouped products."""
