"""Rank-side benchmark bodies: each public function runs on every rank as ``fn(ctx, **kwargs)``
(a :class:`conformance.context.CheckContext`) and returns a picklable dict for the driver."""
