"""Reading a `/metrics` answer the way Prometheus does (prometheus-client's own parser)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(exposition: str) -> dict[str, float]:
    """Each unlabelled sample by name (`name{labels}` for labelled ones), as a number."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
