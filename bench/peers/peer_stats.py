"""Statistics and the row shape shared by the peer scripts (a helper module, not a suite)."""


def percentile(sorted_vals, q):
    """numpy's default 'linear' percentile of an ascending list (as warpdrive's Stats)."""
    h = (len(sorted_vals) - 1) * q
    lo = int(h)
    if lo + 1 < len(sorted_vals):
        return sorted_vals[lo] + (h - lo) * (sorted_vals[lo + 1] - sorted_vals[lo])
    return sorted_vals[lo]


def timed_row(suite, case, size, variant, samples, extra):
    """A results row of µs `samples` (median, p10, p90); `gbps` counts `size` bytes."""
    s = sorted(samples)
    median = percentile(s, 0.5)
    return {
        "suite": suite,
        "case": case,
        "size": int(size),
        "variant": variant,
        "median": median,
        "p10": percentile(s, 0.1),
        "p90": percentile(s, 0.9),
        "unit": "us",
        "gbps": size / (median * 1e3) if median > 0 else None,
        "tflops": None,
        "pct_of_ceiling": None,
        "extra": extra,
    }
