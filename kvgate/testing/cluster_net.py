"""Service networking for `make cluster`'s node, on loopback only: the parts a cluster's DNS
add-on and a load-balancer provider (cloud-provider-kind, MetalLB) give a kind cluster.

- **Cluster DNS.** A DNS server on ``DNS_ADDRESS`` answers ``<service>.<namespace>.svc.cluster.local``
  with the addresses of the Service's ready endpoints (its pods' loopback addresses), as a
  headless Service resolves: a ClusterIP leads nowhere here (no kube-proxy), so it is never
  handed out. Every other name is NXDOMAIN: nothing is forwarded off the machine. Pods get it in
  their /etc/resolv.conf with the usual search list.
- **LoadBalancer Services.** Each gets an address of ``LB_NETWORK`` (127.11.x.y) in
  ``status.loadBalancer.ingress``, where a TCP forwarder listens on each of its ports and
  passes every connection to a ready endpoint (round-robin): what a user's `curl` to a
  Gateway's address reaches.

Endpoints come from the Services' selectors over the Pods (ready, with an address), as
kube-proxy's EndpointSlices would give them: the API server refuses loopback addresses in an
EndpointSlice, so this cluster has none for its pods. A name that is no Service's (a process on
the node, Envoy Gateway's controller) can be given a fixed address (`static`). State comes from
polling Services and Pods each second (a small cluster: two lists).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import itertools
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import httpx

from kvgate.testing.netns_relay import splice

log = logging.getLogger("kvgate.node.net")

DNS_ADDRESS = "127.10.255.253"  # kept out of the pods' range by the node agent
DNS_DOMAIN = "cluster.local"
LB_NETWORK = ipaddress.ip_network("127.11.0.0/16")
MERGE = {"Content-Type": "application/merge-patch+json"}
TTL = 2


def resolv_conf(namespace: str) -> str:
    """A pod's /etc/resolv.conf (dnsPolicy ClusterFirst)."""
    search = f"{namespace}.svc.{DNS_DOMAIN} svc.{DNS_DOMAIN} {DNS_DOMAIN}"
    return f"nameserver {DNS_ADDRESS}\nsearch {search}\noptions ndots:5\n"


@dataclass
class Backend:
    """A Service's ready endpoints: each pod's address and the port each Service port targets."""

    endpoints: list[tuple[str, dict[int, int]]] = field(default_factory=list)

    @property
    def addresses(self) -> list[str]:
        return [ip for ip, _ in self.endpoints]


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    ip = status.get("podIP") or ""
    try:
        if not ipaddress.ip_address(ip).is_loopback:
            return False  # never an address off this machine
    except ValueError:
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _target_ports(service: dict[str, Any], pod: dict[str, Any]) -> dict[int, int]:
    named = {
        p["name"]: int(p["containerPort"])
        for c in pod["spec"].get("containers") or []
        for p in c.get("ports") or []
        if p.get("name")
    }
    out = {}
    for port in service["spec"].get("ports") or []:
        target = port.get("targetPort", port["port"])
        number = named.get(target) if isinstance(target, str) else int(target)
        if number is not None:
            out[int(port["port"])] = number
    return out


def backends_of(services: list[dict[str, Any]], pods: list[dict[str, Any]]) -> dict[tuple[str, str], Backend]:
    """Each selector Service's ready pods, as its endpoints."""
    out: dict[tuple[str, str], Backend] = {}
    for svc in services:
        selector = svc["spec"].get("selector") or {}
        if not selector:
            continue
        ns = svc["metadata"]["namespace"]
        b = out[(ns, svc["metadata"]["name"])] = Backend()
        for pod in pods:
            labels = pod["metadata"].get("labels") or {}
            if (
                pod["metadata"]["namespace"] == ns
                and _ready(pod)
                and all(labels.get(k) == v for k, v in selector.items())
            ):
                b.endpoints.append((pod["status"]["podIP"], _target_ports(svc, pod)))
    return out


@dataclass
class Balancer:
    """One LoadBalancer Service's address and its listening forwarders."""

    ip: str
    servers: dict[int, asyncio.Server] = field(default_factory=dict)
    turn: itertools.count[int] = field(default_factory=itertools.count)


class ClusterNetwork:
    def __init__(self, api: httpx.AsyncClient, static: dict[str, str] | None = None) -> None:
        self.api = api
        self.static = {k.lower().rstrip("."): v for k, v in (static or {}).items()}  # name -> address
        self.backends: dict[tuple[str, str], Backend] = {}
        self.services: dict[tuple[str, str], dict[str, Any]] = {}
        self.balancers: dict[tuple[str, str], Balancer] = {}
        self._free_lb = iter(LB_NETWORK.hosts())

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _DnsProtocol(self), local_addr=(DNS_ADDRESS, 53)
        )
        tcp = await asyncio.start_server(self._dns_tcp, DNS_ADDRESS, 53)
        log.info("cluster DNS on %s:53", DNS_ADDRESS)
        try:
            while True:
                try:
                    await self._sync()
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    log.warning("service sync failed: %s", exc)
                await asyncio.sleep(1)
        finally:
            transport.close()
            tcp.close()
            for balancer in self.balancers.values():
                for server in balancer.servers.values():
                    server.close()

    # -- state ---------------------------------------------------------------------------------
    async def _list(self, path: str) -> list[dict[str, Any]]:
        resp = await self.api.get(path)
        resp.raise_for_status()
        return list(resp.json().get("items") or [])

    async def _sync(self) -> None:
        services = await self._list("/api/v1/services")
        pods = await self._list("/api/v1/pods")
        self.backends = backends_of(services, pods)
        self.services = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in services}
        balanced = {k for k, s in self.services.items() if s["spec"].get("type") == "LoadBalancer"}
        for key in balanced:
            await self._balance(key, self.services[key])
        for key in set(self.balancers) - balanced:
            for server in self.balancers.pop(key).servers.values():
                server.close()

    # -- LoadBalancer Services -----------------------------------------------------------------
    async def _balance(self, key: tuple[str, str], svc: dict[str, Any]) -> None:
        balancer = self.balancers.get(key)
        if balancer is None:
            balancer = self.balancers[key] = Balancer(str(next(self._free_lb)))
        ports = {
            int(p["port"]): p for p in svc["spec"].get("ports") or [] if p.get("protocol", "TCP") == "TCP"
        }
        for port, server in list(balancer.servers.items()):
            if port not in ports:
                server.close()
                del balancer.servers[port]
        for port, spec in ports.items():
            if port not in balancer.servers:
                handler = functools.partial(self._forward, key=key, spec=spec, balancer=balancer)
                balancer.servers[port] = await asyncio.start_server(handler, balancer.ip, port)
                log.info("service %s/%s: %s:%d", *key, balancer.ip, port)
        ingress = ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
        if [i.get("ip") for i in ingress] != [balancer.ip]:
            status = {"status": {"loadBalancer": {"ingress": [{"ip": balancer.ip, "ipMode": "VIP"}]}}}
            resp = await self.api.patch(
                f"/api/v1/namespaces/{key[0]}/services/{key[1]}/status",
                content=json.dumps(status),
                headers=MERGE,
            )
            resp.raise_for_status()

    def _target(
        self, key: tuple[str, str], spec: dict[str, Any], balancer: Balancer
    ) -> tuple[str, int] | None:
        backend = self.backends.get(key)
        port = int(spec["port"])
        ready = [(ip, ports[port]) for ip, ports in backend.endpoints if port in ports] if backend else []
        if not ready:
            return None
        return ready[next(balancer.turn) % len(ready)]

    async def _forward(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        key: tuple[str, str],
        spec: dict[str, Any],
        balancer: Balancer,
    ) -> None:
        target = self._target(key, spec, balancer)
        if target is None:  # no ready endpoint: refuse, as a load balancer with no backend does
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        await splice(reader, writer, up_reader, up_writer)

    # -- DNS -------------------------------------------------------------------------------------
    def answer(self, wire: bytes) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except Exception:  # malformed: no answer, as a resolver drops garbage
            return None
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        if not query.question:
            reply.set_rcode(dns.rcode.FORMERR)
            return bytes(reply.to_wire())
        question = query.question[0]
        addresses = self._lookup(question.name.to_text(omit_final_dot=True).lower())
        if addresses is None:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A and addresses:
            reply.answer.append(
                dns.rrset.from_text_list(question.name, TTL, dns.rdataclass.IN, dns.rdatatype.A, addresses)
            )
        return bytes(reply.to_wire())

    def _lookup(self, name: str) -> list[str] | None:
        """A Service's ready addresses; [] for a Service without any; None for no such name."""
        if name in self.static:
            return [self.static[name]]
        suffix = f".svc.{DNS_DOMAIN}"
        if not name.endswith(suffix):
            return None
        parts = name[: -len(suffix)].split(".")
        if len(parts) != 2 or (parts[1], parts[0]) not in self.services:
            return None
        backend = self.backends.get((parts[1], parts[0]))
        return sorted(set(backend.addresses)) if backend else []

    async def _dns_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            size = int.from_bytes(await reader.readexactly(2), "big")
            reply = self.answer(await reader.readexactly(size))
            if reply is not None:
                writer.write(len(reply).to_bytes(2, "big") + reply)
                await writer.drain()
        writer.close()


class _DnsProtocol(asyncio.DatagramProtocol):
    def __init__(self, net: ClusterNetwork) -> None:
        self.net = net
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a datagram endpoint's transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = self.net.answer(data)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)
