"""Prometheus text parsed by prometheus-client's parser, as Prometheus reads it, for assertions."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Samples:
    """Every sample of one scrape: (sample name, sorted label pairs) -> value; `types` by family."""

    values: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    types: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> Samples:
        values, types = {}, {}
        for family in text_string_to_metric_families(text):
            types[family.name] = family.type
            for sample in family.samples:
                values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return cls(values, types)

    def get(self, name: str, **labels: str) -> float:
        """The one sample `name` whose labels include `labels` (0.0 when there is none)."""
        wanted = set(labels.items())
        found = [v for (n, pairs), v in self.values.items() if n == name and wanted <= set(pairs)]
        assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
        return found[0] if found else 0.0

    def labels(self, name: str) -> list[dict[str, str]]:
        return [dict(pairs) for (n, pairs) in self.values if n == name]

    def delta(self, before: Samples, name: str, **labels: str) -> float:
        return self.get(name, **labels) - before.get(name, **labels)

    @property
    def sample_names(self) -> set[str]:
        return {name for name, _ in self.values}
