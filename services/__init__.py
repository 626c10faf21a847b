"""tessera's server side: the five services (gateway, vision, decoder, pooling, adapters) and what they share
(common). Each runs as `python -m services.<name>`; `tessera up` starts them all. Installed as the
`tessera-server` distribution (services/pyproject.toml), over the `tessera` client distribution."""
