"""Where a client is: its home region, from a header a CDN sets, a table of IP prefixes, or by default the
gateway's own region. Round trips, cross-region decisions and the remote-share cap are all relative to it."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator


class HomeSettings(BaseModel):
    """The ``[gateway.home]`` table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    header: str | None = Field(default=None, description="header naming the client's place (e.g. a CDN's)")
    header_regions: dict[str, str] = Field(
        default_factory=dict, description="header value -> region; a region's own name maps to itself"
    )
    ip_prefixes: dict[str, str] = Field(default_factory=dict, description='"10.1.0.0/16" = "us-east"')
    trust_forwarded_for: bool = Field(
        default=False, description="use the first X-Forwarded-For address (only behind a proxy you run)"
    )

    @field_validator("ip_prefixes")
    @classmethod
    def _networks(cls, value: dict[str, str]) -> dict[str, str]:
        for prefix in value:
            try:
                ipaddress.ip_network(prefix, strict=False)
            except ValueError as exc:
                raise ValueError(f"{prefix!r} is not an IP prefix: {exc}") from None
        return value


class HomeRegions:
    def __init__(self, settings: HomeSettings, regions: list[str], default: str) -> None:
        mapped = {*settings.header_regions.values(), *settings.ip_prefixes.values()}
        unknown = sorted(mapped - set(regions))
        if unknown:
            raise ValueError(f"gateway.home maps to unknown regions: {', '.join(unknown)}")
        self.settings = settings
        self.default = default
        self._regions = {r.lower(): r for r in regions}
        self._header = settings.header.lower() if settings.header else None
        self._by_value = {k.lower(): v for k, v in settings.header_regions.items()}
        # Longest prefix first, so the most specific entry wins.
        self._networks = sorted(
            ((ipaddress.ip_network(p, strict=False), r) for p, r in settings.ip_prefixes.items()),
            key=lambda item: item[0].prefixlen,
            reverse=True,
        )

    def resolve(self, headers: Mapping[str, str], remote: str | None) -> str:
        if self._header is not None:
            value = headers.get(self._header)
            if value:
                value = value.strip().lower()
                region = self._by_value.get(value) or self._regions.get(value)
                if region is not None:
                    return region
        if self._networks:
            address = remote
            if self.settings.trust_forwarded_for and headers.get("x-forwarded-for"):
                address = headers["x-forwarded-for"].split(",")[0].strip()
            if address:
                try:
                    ip = ipaddress.ip_address(address)
                except ValueError:
                    ip = None
                if ip is not None:
                    for network, region in self._networks:
                        if ip.version == network.version and ip in network:
                            return region
        return self.default
