"""Reading Prometheus text-format metrics (a Triton server's /metrics page)."""
from __future__ import annotations

import re

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}\s+(\S+)', re.MULTILINE)


def metric_sum(text: str, name: str, model: str) -> float:
    """Sum of the samples of `name` whose `model` label is `model` (all instances and versions)."""
    total = 0.0
    for metric, labels, value in _SAMPLE.findall(text):
        if metric == name and f'model="{model}"' in labels:
            try:
                total += float(value)
            except ValueError:
                pass
    return total


def metric_label(text: str, name: str, model: str, label: str) -> str | None:
    """The `label` value of the sample of info-style `name` (one sample at 1 per model) for `model`, or None."""
    for metric, labels, value in _SAMPLE.findall(text):
        if metric == name and f'model="{model}"' in labels and value in ("1", "1.0"):
            found = re.search(r'%s="([^"]*)"' % re.escape(label), labels)
            if found:
                return found.group(1)
    return None
