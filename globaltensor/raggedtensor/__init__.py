"""Ragged tensors: a Split whose per-rank sizes are data (`gt.ragged(d)`), the layout of tokens routed to
experts. `tensor` is the class and its conversions, `cuts` the sizes' arithmetic, `ops` the op path,
`rules` and `views` their layouts, `grouped` the experts' grouped products."""
