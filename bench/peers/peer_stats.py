"""Statistics shared by the peer scripts (a helper module, not a suite)."""


def percentile(sorted_vals, q):
    """numpy's default 'linear' percentile of an ascending list (as warpdrive's Stats)."""
    h = (len(sorted_vals) - 1) * q
    lo = int(h)
    if lo + 1 < len(sorted_vals):
        return sorted_vals[lo] + (h - lo) * (sorted_vals[lo + 1] - sorted_vals[lo])
    return sorted_vals[lo]
