# Offline checks of deploy/, config/gateway.toml and the Dockerfile; run by scripts/deploy-check, in its venv.
"""Renders every kustomization under deploy/ the way kustomize would (for the fields used here), validates each
resource against the Kubernetes schemas with kubernetes-validate (strict) and each custom resource against the
openAPIV3Schema of its CRD's checked-in copy in deploy/crds (strict too: unknown fields fail) and its CEL rules
(deploy_check_cel), then checks that the manifests, the gateway configuration, the InferencePool example's endpoint
picker, the shared-limits example's Redis and the Dockerfile agree with each other, and that oipgate accepts each
configuration a ConfigMap carries.

Every failure is printed as `FAIL ...` with what was expected; the exit status is 1 when any check failed.
"""

import base64
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

import jsonschema
import kubernetes_validate
import yaml

import deploy_check_cel

_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: the CRD copies are large

KUBERNETES_VERSION = "1.30"
ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
WITH_MODEL_SERVERS = DEPLOY / "examples" / "with-model-servers"
INFERENCE_POOL = DEPLOY / "examples" / "inference-pool"
SHARED_LIMITS = DEPLOY / "examples" / "shared-limits"
# Verbatim copies of upstream CustomResourceDefinitions (a comment header names each one's source); the schemas the
# custom resources are validated against. Not a kustomization: nothing here is applied.
CRDS = DEPLOY / "crds"
CONFIG = ROOT / "config" / "gateway.toml"
DOCKERFILE = ROOT / "Dockerfile"
CONFIG_MAP = "oipgate-config"
CONFIG_KEY = "gateway.toml"
CONFIG_DIR = "/etc/oipgate"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
GATEWAY = "oipgate"
READY_PATH = "/v2/health/ready"
LIVE_PATH = "/v2/health/live"
PORT_NAMES = ("rest", "grpc", "metrics")
# The endpoint picker of deploy/examples/inference-pool: `oipgate epp`, ext_proc and grpc.health.v1 on [listen] epp.
EPP = "oipgate-epp"
EPP_CONFIG_MAP = "oipgate-epp-config"
EPP_PORT_NAMES = ("epp", "metrics")
EPP_HEALTH = {"readinessProbe": "readiness", "livenessProbe": "liveness"}
EPP_SERVICE_APP_PROTOCOLS = ("http2", "kubernetes.io/h2c")  # gRPC in clear text, as the Gateway must dial it
INFERENCE_GROUP = "inference.networking.k8s.io"
# InferencePool appProtocol (default http) for each oipgate backend protocol.
POOL_APP_PROTOCOL = {"rest": "http", "grpc": "kubernetes.io/h2c"}
# deploy/examples/shared-limits: the environment variable that gives the gateway its Redis URL, password included.
REDIS_URL_ENV = "OIPGATE__LIMITS__SHARED__REDIS"

# The kustomization fields this renderer implements; any other field fails the check rather than being ignored.
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "namespace", "labels", "commonLabels", "images", "patches"}
# Kinds whose label and namespace handling below is complete (kustomize's fieldspecs for them).
SUPPORTED_KINDS = {
    ("", "ConfigMap"),
    ("", "Secret"),
    ("", "Service"),
    ("apps", "Deployment"),
    ("autoscaling", "HorizontalPodAutoscaler"),
    ("policy", "PodDisruptionBudget"),
    ("networking.k8s.io", "NetworkPolicy"),
    # Custom resources: kustomize has no fieldspecs for them beyond metadata (labels, namespace), nor do we.
    (INFERENCE_GROUP, "InferencePool"),
    ("gateway.networking.k8s.io", "HTTPRoute"),
    ("gateway.networking.k8s.io", "GRPCRoute"),
}
# kustomize's commonLabels fieldspecs (api/internal/konfig/builtinpluginconsts) for the supported kinds:
# (kind, path, create). `labels` with includeSelectors uses all of them; includeTemplates only the templates.
_AFFINITY = "spec/template/spec/affinity"
SELECTOR_FIELDS = [
    ("Service", "spec/selector", True),
    ("Deployment", "spec/selector/matchLabels", True),
    ("Deployment", f"{_AFFINITY}/podAffinity/preferredDuringSchedulingIgnoredDuringExecution/podAffinityTerm/labelSelector/matchLabels", False),  # noqa: E501
    ("Deployment", f"{_AFFINITY}/podAffinity/requiredDuringSchedulingIgnoredDuringExecution/labelSelector/matchLabels", False),  # noqa: E501
    ("Deployment", f"{_AFFINITY}/podAntiAffinity/preferredDuringSchedulingIgnoredDuringExecution/podAffinityTerm/labelSelector/matchLabels", False),  # noqa: E501
    ("Deployment", f"{_AFFINITY}/podAntiAffinity/requiredDuringSchedulingIgnoredDuringExecution/labelSelector/matchLabels", False),  # noqa: E501
    ("Deployment", "spec/template/spec/topologySpreadConstraints/labelSelector/matchLabels", False),
    ("PodDisruptionBudget", "spec/selector/matchLabels", False),
    ("NetworkPolicy", "spec/podSelector/matchLabels", False),
    ("NetworkPolicy", "spec/ingress/from/podSelector/matchLabels", False),
    ("NetworkPolicy", "spec/egress/to/podSelector/matchLabels", False),
]
TEMPLATE_FIELDS = [("Deployment", "spec/template/metadata/labels", True)]
# Strategic merge patches: the lists a patch may reach, each merged element by element on its Kubernetes
# patchMergeKey. Any other list (some replace, some merge on keys not listed here) fails rather than be merged wrongly.
PATCH_MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
                    "volumeMounts": "mountPath"}

failures = []


class Fatal(Exception):
    """A problem that makes the checks after it meaningless."""


def rel(path):
    return str(Path(path).resolve().relative_to(ROOT))


def fail(message):
    failures.append(message)
    print(f"FAIL {message}")


def check(condition, message):
    if not condition:
        fail(message)
    return condition


def ok(message):
    print(f"  ok  {message}")


def section(title):
    print(f"== {title}")


def kn(resource):
    return f"{resource.get('kind')}/{resource.get('metadata', {}).get('name')}"


def group_of(resource):
    api_version = resource["apiVersion"]
    return api_version.split("/")[0] if "/" in api_version else ""


def load_yaml(path):
    try:
        with open(path, encoding="utf-8") as f:
            return [doc for doc in yaml.load_all(f, Loader=_YAML_LOADER) if doc is not None]
    except yaml.YAMLError as e:
        raise Fatal(f"{rel(path)} is not valid YAML: {e}") from e


# ---------------------------------------------------------------------------------------------------------------
# Rendering: a kustomize subset, strict about what it does not implement.


def set_labels_at(node, segments, pairs, create):
    """Adds `pairs` to the map at `segments` below `node`, walking every element of lists on the way (like
    kustomize's fieldspec paths). Creates missing maps only when `create`."""
    if isinstance(node, list):
        for item in node:
            set_labels_at(item, segments, pairs, create)
        return
    if not isinstance(node, dict):
        return
    head, rest = segments[0], segments[1:]
    if head not in node or node[head] is None:
        if not create:
            return
        node[head] = {}
    if rest:
        set_labels_at(node[head], rest, pairs, create)
    elif isinstance(node[head], dict):
        node[head].update(pairs)
    else:
        raise Fatal(f"cannot add labels at {'/'.join(segments)}: not a map")


def apply_labels(resources, pairs, include_selectors, include_templates):
    for resource in resources:
        resource.setdefault("metadata", {})
        set_labels_at(resource, ["metadata", "labels"], pairs, True)
        specs = (SELECTOR_FIELDS + TEMPLATE_FIELDS) if include_selectors else (
            TEMPLATE_FIELDS if include_templates else [])
        for kind, path, create in specs:
            if resource["kind"] == kind:
                set_labels_at(resource, path.split("/"), pairs, create)


def split_image(image):
    """`name[:tag][@digest]` into its three parts (a registry port is part of the name)."""
    name, _, digest = image.partition("@")
    tag = ""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, digest


def apply_images(resources, images):
    for entry in images:
        unknown = set(entry) - {"name", "newName", "newTag", "digest"}
        if unknown or "name" not in entry:
            raise Fatal(f"images entry {entry}: needs `name`, takes newName/newTag/digest only")
        for resource in resources:
            if resource["kind"] != "Deployment":
                continue
            pod = resource.get("spec", {}).get("template", {}).get("spec", {})
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                name, tag, digest = split_image(container.get("image", ""))
                if name != entry["name"]:
                    continue
                name = entry.get("newName", name)
                if "digest" in entry:
                    container["image"] = f"{name}@{entry['digest']}"
                elif "newTag" in entry:
                    container["image"] = f"{name}:{entry['newTag']}"
                else:
                    container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def merge_patch(target, patch, where):
    """Applies a strategic merge patch to `target` in place: maps merge, null removes a key, the lists of
    PATCH_MERGE_KEYS merge on their key (the patch's elements first, in its order, then the target's others, as
    kustomize orders them); anything else the patch sets replaces the target's value."""
    for key, value in patch.items():
        if key.startswith("$"):
            raise Fatal(f"{where}: {key} is a patch directive scripts/deploy_check.py does not implement")
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_patch(target[key], value, f"{where}/{key}")
        elif isinstance(value, list) or isinstance(target.get(key), list):
            merge_key = PATCH_MERGE_KEYS.get(key)
            if merge_key is None or not isinstance(value, list) or not isinstance(target.get(key, []), list):
                raise Fatal(f"{where}/{key}: patching this list is not implemented by scripts/deploy_check.py (it "
                            f"merges {', '.join(sorted(PATCH_MERGE_KEYS))} only)")
            original = target.get(key) or []
            merged, patched = [], set()
            for item in value:
                if not isinstance(item, dict) or merge_key not in item:
                    raise Fatal(f"{where}/{key}: every element needs its merge key {merge_key}")
                patched.add(item[merge_key])
                match = next((o for o in original if o.get(merge_key) == item[merge_key]), None)
                element = copy.deepcopy(match) if match is not None else {}
                merge_patch(element, item, f"{where}/{key}[{item[merge_key]}]")
                merged.append(element)
            target[key] = merged + [o for o in original if o.get(merge_key) not in patched]
        else:
            target[key] = copy.deepcopy(value)


def apply_patches(resources, entries, directory, path):
    """kustomize `patches` of strategic merge patches that name their target (kind, name, namespace if set) in
    themselves; returns the patch files, which are not resources of their own."""
    files = set()
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"path"}:
            raise Fatal(f"{rel(path)}: patches entry {entry} must be `path: FILE` alone (a strategic merge patch "
                        "naming its target); scripts/deploy_check.py renders no other form")
        patch_path = (directory / entry["path"]).resolve()
        if not patch_path.is_file():
            raise Fatal(f"{rel(path)}: patch {entry['path']!r} does not exist")
        files.add(patch_path)
        for patch in load_yaml(patch_path):
            if not isinstance(patch, dict) or not {"apiVersion", "kind", "metadata"} <= set(patch) \
                    or not patch["metadata"].get("name"):
                raise Fatal(f"{rel(patch_path)}: every patch needs apiVersion, kind and metadata.name")
            namespace = patch["metadata"].get("namespace")
            targets = [r for r in resources if r["apiVersion"] == patch["apiVersion"] and r["kind"] == patch["kind"]
                       and r["metadata"]["name"] == patch["metadata"]["name"]
                       and namespace in (None, r["metadata"].get("namespace", "default"))]
            if len(targets) != 1:
                raise Fatal(f"{rel(patch_path)}: {kn(patch)} matches {len(targets)} resources of {rel(directory)}, "
                            "want exactly one")
            merge_patch(targets[0], patch, f"{rel(patch_path)} {kn(patch)}")
            targets[0]["_source"] += f" + {rel(patch_path)}"
    return files


def render(directory, stack=()):
    """The resources `kustomize build directory` would give, for the fields in KUSTOMIZATION_FIELDS."""
    directory = directory.resolve()
    if directory in stack:
        raise Fatal(f"kustomization cycle through {rel(directory)}")
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise Fatal(f"{rel(directory)} has no kustomization.yaml")
    docs = load_yaml(path)
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise Fatal(f"{rel(path)} must hold exactly one mapping")
    k = docs[0]
    unknown = set(k) - KUSTOMIZATION_FIELDS
    if unknown:
        raise Fatal(f"{rel(path)} uses {sorted(unknown)}, which scripts/deploy_check.py does not render; "
                    f"extend its renderer (it handles {sorted(KUSTOMIZATION_FIELDS)})")
    if k.get("apiVersion") != "kustomize.config.k8s.io/v1beta1" or k.get("kind") != "Kustomization":
        raise Fatal(f"{rel(path)} must be apiVersion kustomize.config.k8s.io/v1beta1, kind Kustomization")

    resources = []
    listed = set()
    for entry in k.get("resources") or []:
        if not isinstance(entry, str) or "://" in entry or entry.startswith(("github.com/", "git@")):
            raise Fatal(f"{rel(path)}: resource {entry!r} is not a local file or directory")
        target = (directory / entry).resolve()
        if target.is_dir():
            resources += render(target, stack + (directory,))
        elif target.is_file():
            listed.add(target)
            for doc in load_yaml(target):
                if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= set(doc):
                    raise Fatal(f"{rel(target)}: every document needs apiVersion, kind and metadata")
                if not doc["metadata"].get("name"):
                    raise Fatal(f"{rel(target)}: a {doc['kind']} has no metadata.name")
                doc["_source"] = rel(target)
                resources.append(doc)
        else:
            raise Fatal(f"{rel(path)} lists {entry!r}, which does not exist")
    # kustomize patches first, then namespace, labels and images (below).
    listed |= apply_patches(resources, k.get("patches") or [], directory, path)

    # Every manifest next to the kustomization is one it lists: nothing is silently left out of `kubectl apply -k`.
    for candidate in sorted(list(directory.glob("*.yaml")) + list(directory.glob("*.yml"))):
        if candidate.name in ("kustomization.yaml", "kustomization.yml"):
            continue
        if candidate.resolve() not in listed:
            raise Fatal(f"{rel(candidate)} is not listed in {rel(path)}'s resources")

    for resource in resources:
        if (group_of(resource), resource["kind"]) not in SUPPORTED_KINDS:
            raise Fatal(f"{resource['_source']}: {kn(resource)} ({resource['apiVersion']}) is a kind whose "
                        "kustomize label handling scripts/deploy_check.py does not implement; extend it")

    # kustomize's order after the patches: namespace, then labels, then images.
    if "namespace" in k:
        for resource in resources:
            resource["metadata"]["namespace"] = k["namespace"]
    if k.get("commonLabels"):
        apply_labels(resources, k["commonLabels"], True, True)
    for entry in k.get("labels") or []:
        unknown = set(entry) - {"pairs", "includeSelectors", "includeTemplates"}
        if unknown or not isinstance(entry.get("pairs"), dict):
            raise Fatal(f"{rel(path)}: labels entry {entry} needs `pairs` and takes includeSelectors/"
                        "includeTemplates only")
        apply_labels(resources, entry["pairs"], bool(entry.get("includeSelectors")),
                     bool(entry.get("includeTemplates")))
    apply_images(resources, k.get("images") or [])

    seen = set()
    for resource in resources:
        key = (resource["kind"], resource["metadata"].get("namespace", ""), resource["metadata"]["name"])
        if key in seen:
            raise Fatal(f"{rel(directory)}: {kn(resource)} appears twice")
        seen.add(key)
    return resources


def validate(resources, crds):
    """Strict schema validation of each rendered resource; prints one line per resource."""
    for resource in resources:
        document = {key: value for key, value in resource.items() if key != "_source"}
        where = f"{kn(resource)} ({resource['_source']})"
        if (group_of(resource), resource["kind"]) in crds:
            validate_custom(document, where, crds[(group_of(resource), resource["kind"])])
            continue
        try:
            version = kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            field = ".".join(str(part) for part in e.path) or "(top level)"
            fail(f"{where} is not a valid {resource['apiVersion']} {resource['kind']} for Kubernetes "
                 f"{e.version}: {field}: {e.message}")
            continue
        except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
            fail(f"{where}: {e.message}")
            continue
        except Exception as e:  # noqa: BLE001 - anything else the validator trips on is a failure too
            fail(f"{where} could not be validated: {type(e).__name__}: {e}")
            continue
        ok(f"{where}: valid for Kubernetes {version} (strict)")


# ---------------------------------------------------------------------------------------------------------------
# Custom resources: validated against the openAPIV3Schema of their CRD's checked-in copy, as an API server would with
# strict field validation (kubectl's default): unknown fields fail instead of being pruned.

CRD_SOURCE = re.compile(r"^# Source: https://github\.com/[\w.-]+/[\w.-]+\n#   path: +\S+\n#   tag: +\S+\n"
                        r"#   commit: +[0-9a-f]{40}$", re.MULTILINE)
# OpenAPI keywords that validate nothing (or nothing checked here: `format`, whose int32/int64/date-time the API
# server checks loosely). The CEL rules of x-kubernetes-validations are evaluated apart (deploy_check_cel).
_ANNOTATIONS = {"description", "default", "example", "externalDocs", "nullable", "format", "title"}


def strict_schema(schema):
    """An OpenAPI v3 structural schema as a JSON Schema (draft 4, OpenAPI 3.0's base) that refuses what structural
    pruning would drop: every object without additionalProperties or x-kubernetes-preserve-unknown-fields takes its
    listed properties only."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = strict_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [strict_schema(sub) for sub in value]
        elif key.startswith("x-kubernetes-") or key in _ANNOTATIONS:
            continue
        else:
            out[key] = value
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (schema.get("type") == "object" and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
            and not schema.get("x-kubernetes-embedded-resource")):
        out["additionalProperties"] = False
    return out


def load_crds():
    """(group, kind) -> {version: (validator, CEL rules, source file)} for the served versions of every CRD copy in
    deploy/crds, each of which must name its upstream source."""
    crds = {}
    for path in sorted(list(CRDS.glob("*.yaml")) + list(CRDS.glob("*.yml"))):
        text = path.read_text(encoding="utf-8")
        header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
        if not CRD_SOURCE.search(header):
            fail(f"{rel(path)}: its comment header must name the upstream source: `# Source: https://github.com/"
                 "OWNER/REPO` then `#   path:`, `#   tag:` and `#   commit:` (40 hex digits) lines")
        docs = load_yaml(path)
        if len(docs) != 1 or docs[0].get("kind") != "CustomResourceDefinition":
            raise Fatal(f"{rel(path)} must hold exactly one CustomResourceDefinition")
        spec = docs[0]["spec"]
        versions = {}
        for version in spec["versions"]:
            if not version.get("served"):
                continue
            schema = strict_schema(version["schema"]["openAPIV3Schema"])
            # metadata is the API server's ObjectMeta, checked as a core object's below.
            schema.setdefault("properties", {})["metadata"] = {"type": "object"}
            jsonschema.Draft4Validator.check_schema(schema)
            rules = deploy_check_cel.Rules(version["schema"]["openAPIV3Schema"])
            versions[version["name"]] = (jsonschema.Draft4Validator(schema), rules, rel(path))
        crds[(spec["group"], spec["names"]["kind"])] = versions
        ok(f"{rel(path)}: {spec['names']['kind']}.{spec['group']}, served versions {', '.join(versions)}")
    return crds


def validate_custom(document, where, versions):
    version = document["apiVersion"].split("/")[-1]
    if version not in versions:
        fail(f"{where}: {document['apiVersion']} is not a served version of its CRD ({', '.join(versions)})")
        return
    validator, rules, source = versions[version]
    errors = sorted(validator.iter_errors(document), key=lambda e: [str(p) for p in e.absolute_path])
    for error in errors:
        field = ".".join(str(part) for part in error.absolute_path) or "(top level)"
        fail(f"{where} is not a valid {document['apiVersion']} {document['kind']} ({source}): {field}: "
             f"{error.message}")
    # ObjectMeta (name, namespace, labels, annotations ...) as the API server checks it for any object.
    stub = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": document.get("metadata", {})}
    try:
        kubernetes_validate.validate(stub, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        errors = [e]
        fail(f"{where}: metadata.{'.'.join(str(p) for p in list(e.path)[1:])}: {e.message}")
    if errors:
        return
    # The CEL rules read a resource the schema admits (a rule reading a field of the wrong type only errs).
    broken = rules.failures(document)
    for failure in broken:
        fail(f"{where} breaks a CEL rule of {source}: {failure}")
    if not broken:
        ok(f"{where}: valid for {source} (strict; holds its CEL rules: {rules.evaluated} in the schema, "
           f"{rules.on_update} more for updates only)")


# What each mutation of the InferencePool example's resources breaks: (kind, what it does, change, the message of the
# rule that must refuse it). Each mutation is valid by the schema alone, so only the CEL evaluation can refuse it.
CEL_MUTATIONS = [
    ("HTTPRoute", "a path prefix without its leading slash",
     lambda route: route["spec"]["rules"][0]["matches"][0]["path"].update(value="inference.GRPCInferenceService/"),
     "value must be an absolute path and start with '/' when type one of ['Exact', 'PathPrefix']"),
    ("GRPCRoute", "a method match naming neither service nor method (its type defaulted to Exact)",
     lambda route: route["spec"]["rules"][0]["matches"][0].update(method={}),
     "One or both of 'service' or 'method' must be specified"),
    ("GRPCRoute", "a service name with a slash",
     lambda route: route["spec"]["rules"][0]["matches"][0]["method"].update(service="inference/GRPCInference"),
     "service must only contain valid characters"),
    ("InferencePool", "an endpoint picker with no port (its kind defaulted to Service)",
     lambda pool: pool["spec"]["endpointPickerRef"].pop("port"),
     "port is required when kind is 'Service' or unspecified"),
    ("InferencePool", "a target port listed twice",
     lambda pool: pool["spec"]["targetPorts"].append(dict(pool["spec"]["targetPorts"][0])),
     "port number must be unique"),
]


def check_cel_rules(resources, crds):
    """The CEL evaluation refuses what an API server would: each of CEL_MUTATIONS, made to a copy of the InferencePool
    example's resource, passes the schema and breaks the rule it names (and no other); the resource as it is breaks
    none."""
    for kind, what, change, message in CEL_MUTATIONS:
        resource = next((r for r in resources if r["kind"] == kind), None)
        if resource is None:
            fail(f"{rel(INFERENCE_POOL)} has no {kind} to check the CEL rules on")
            continue
        document = copy.deepcopy({key: value for key, value in resource.items() if key != "_source"})
        change(document)
        validator, rules, source = crds[(group_of(resource), kind)][document["apiVersion"].split("/")[-1]]
        schema_errors = [error.message for error in validator.iter_errors(document)]
        broken = rules.failures(document)
        if schema_errors:
            fail(f"{kind} with {what} should pass the schema of {source} and fail only its CEL rules, but the schema "
                 f"refuses it: {schema_errors[0]}")
        elif len(broken) == 1 and message in broken[0]:
            ok(f"{kind} with {what}: refused by {source}'s rule ({broken[0].split(' (rule:')[0]})")
        else:
            fail(f"{kind} with {what} should break exactly the rule `{message}` of {source}; it broke "
                 f"{broken or 'none'}")


def find(resources, kind, name):
    matches = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    if not matches:
        raise Fatal(f"no {kind}/{name} in the rendered manifests")
    return matches[0]


def selects(selector, labels):
    return bool(selector) and all((labels or {}).get(key) == value for key, value in selector.items())


def pod_spec(deployment):
    return deployment["spec"]["template"]["spec"]


def named_container_ports(container):
    return {p.get("name"): p["containerPort"] for p in container.get("ports", [])}


def probe_port(probe, container):
    port = probe.get("httpGet", {}).get("port")
    return named_container_ports(container).get(port) if isinstance(port, str) else port


def listen_port(address, key, where="config/gateway.toml"):
    match = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:\[\]]+):(\d+)", str(address))
    if not match:
        raise Fatal(f"{where}: listen.{key} = {address!r} is not host:port")
    host, port = match.group(1), int(match.group(2))
    check(host in ("0.0.0.0", "[::]"),
          f"{where}: listen.{key} binds {host}; in a pod it must bind every interface (0.0.0.0 or "
          "[::]) for the Service and the kubelet's probes to reach it")
    return port


# ---------------------------------------------------------------------------------------------------------------
# The checks.


def check_gateway(resources, config, config_text):
    before = len(failures)
    deployment = find(resources, "Deployment", GATEWAY)
    containers = pod_spec(deployment)["containers"]
    container = next((c for c in containers if c["name"] == GATEWAY), None)
    if container is None:
        raise Fatal(f"Deployment/{GATEWAY} has no container named {GATEWAY}")

    readiness = container.get("readinessProbe", {}).get("httpGet", {}).get("path")
    liveness = container.get("livenessProbe", {}).get("httpGet", {}).get("path")
    check(readiness == READY_PATH, f"Deployment/{GATEWAY}: readinessProbe path is {readiness!r}, want {READY_PATH}")
    check(liveness == LIVE_PATH, f"Deployment/{GATEWAY}: livenessProbe path is {liveness!r}, want {LIVE_PATH}")

    listen = config.get("listen", {})
    want_ports = {name: listen_port(listen[name], name) for name in PORT_NAMES if name in listen}
    check(set(want_ports) == set(PORT_NAMES), f"config/gateway.toml: [listen] must set {', '.join(PORT_NAMES)}")
    ports = named_container_ports(container)
    check(ports == want_ports,
          f"Deployment/{GATEWAY}: container ports {ports} differ from config/gateway.toml [listen] {want_ports}")
    for probe in ("readinessProbe", "livenessProbe"):
        port = probe_port(container.get(probe, {}), container)
        check(port == want_ports.get("rest"),
              f"Deployment/{GATEWAY}: {probe} goes to port {port}, want the REST port {want_ports.get('rest')}")

    args = container.get("args", [])
    check(args[:3] == ["serve", "--config", CONFIG_PATH],
          f"Deployment/{GATEWAY}: args {args} must start with serve --config {CONFIG_PATH}")
    mounts = [m for m in container.get("volumeMounts", []) if m.get("mountPath") == CONFIG_DIR]
    volumes = {v["name"]: v for v in pod_spec(deployment).get("volumes", [])}
    if check(len(mounts) == 1, f"Deployment/{GATEWAY}: nothing is mounted at {CONFIG_DIR}"):
        mount = mounts[0]
        check("subPath" not in mount and "subPathExpr" not in mount,
              f"Deployment/{GATEWAY}: the config mount uses subPath, which never receives ConfigMap updates")
        source = volumes.get(mount["name"], {}).get("configMap", {}).get("name")
        check(source == CONFIG_MAP,
              f"Deployment/{GATEWAY}: {CONFIG_DIR} is mounted from {source!r}, want ConfigMap {CONFIG_MAP}")

    annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
    check(annotations.get("prometheus.io/scrape") == "true"
          and annotations.get("prometheus.io/port") == str(want_ports.get("metrics"))
          and annotations.get("prometheus.io/path") == "/metrics",
          f"Deployment/{GATEWAY}: prometheus.io annotations {annotations} must scrape /metrics on the metrics port")

    shutdown = config.get("shutdown", {})
    needed_ms = shutdown.get("drain_delay_ms", 0) + shutdown.get("grace_period_ms", 30000)
    grace_s = pod_spec(deployment).get("terminationGracePeriodSeconds", 30)
    check(grace_s * 1000 > needed_ms,
          f"Deployment/{GATEWAY}: terminationGracePeriodSeconds {grace_s} does not outlast the gateway's drain "
          f"and grace period ({needed_ms} ms); the kubelet would kill requests in flight")

    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    service = find(resources, "Service", GATEWAY)
    check(selects(service["spec"].get("selector"), labels),
          f"Service/{GATEWAY}: selector {service['spec'].get('selector')} does not select the pods {labels}")
    service_ports = {p.get("name"): p for p in service["spec"].get("ports", [])}
    check(set(service_ports) == set(PORT_NAMES),
          f"Service/{GATEWAY}: port names {sorted(service_ports)}, want {list(PORT_NAMES)}")
    for name, port in service_ports.items():
        target = port.get("targetPort", port.get("port"))
        target = ports.get(target) if isinstance(target, str) else target
        check(port.get("port") == want_ports.get(name) and target == want_ports.get(name),
              f"Service/{GATEWAY}: port {name} is {port.get('port')} -> {target}, want {want_ports.get(name)}")
    check(service_ports.get("grpc", {}).get("appProtocol") == "grpc",
          f"Service/{GATEWAY}: the grpc port needs appProtocol: grpc")

    pdb = find(resources, "PodDisruptionBudget", GATEWAY)
    check(selects(pdb["spec"].get("selector", {}).get("matchLabels"), labels),
          f"PodDisruptionBudget/{GATEWAY}: selector does not select the gateway's pods")
    hpa = find(resources, "HorizontalPodAutoscaler", GATEWAY)
    target = hpa["spec"]["scaleTargetRef"]
    check(target.get("kind") == "Deployment" and target.get("name") == GATEWAY,
          f"HorizontalPodAutoscaler/{GATEWAY}: scales {target}, want Deployment/{GATEWAY}")

    config_map = find(resources, "ConfigMap", CONFIG_MAP)
    embedded = config_map.get("data", {}).get(CONFIG_KEY)
    if check(embedded is not None, f"ConfigMap/{CONFIG_MAP} has no {CONFIG_KEY} key"):
        check(embedded == config_text,
              f"ConfigMap/{CONFIG_MAP} {CONFIG_KEY} differs from config/gateway.toml; they must be byte-identical "
              "(indent the file by four spaces under `gateway.toml: |` in deploy/base/configmap.yaml)")
    if len(failures) == before:
        ok(f"Deployment/{GATEWAY}: probes {READY_PATH} and {LIVE_PATH} on rest, ports {want_ports} as in [listen], "
           f"{CONFIG_MAP} mounted at {CONFIG_DIR}")
        ok(f"Service/{GATEWAY}: ports {', '.join(PORT_NAMES)} select the gateway's pods; PDB and HPA target them")
        ok(f"ConfigMap/{CONFIG_MAP} {CONFIG_KEY} is byte-identical to config/gateway.toml")
    return embedded


def check_fleet(resources, config, where="config/gateway.toml", example=WITH_MODEL_SERVERS):
    """Each `dns` backend of `config` (named `where`) names a headless Service of the rendered `example`, in its
    namespace, on a port of the backend's protocol, and that Service selects ready-probed pods. Returns
    {backend name: (protocol, Service, port)} for those found."""
    before = len(failures)
    found = {}
    for backend in config.get("backends", []):
        if "dns" not in backend:
            continue
        name, protocol = backend["name"], backend.get("protocol")
        match = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local\.?:(\d+)", backend["dns"])
        if not check(match, f"{where}: backend {name} dns {backend['dns']!r} is not "
                            "<service>.<namespace>.svc.cluster.local:<port>"):
            continue
        service_name, namespace, port = match.group(1), match.group(2), int(match.group(3))
        services = [r for r in resources if r["kind"] == "Service" and r["metadata"]["name"] == service_name]
        if not check(services, f"backend {name}: dns names Service {service_name}, which "
                               f"{rel(example)} does not have"):
            continue
        service = services[0]
        actual_namespace = service["metadata"].get("namespace", "default")
        check(actual_namespace == namespace,
              f"backend {name}: dns names namespace {namespace}, but {rel(example)} puts Service/"
              f"{service_name} in {actual_namespace}")
        check(service["spec"].get("clusterIP") == "None",
              f"Service/{service_name} must be headless (clusterIP: None) for DNS to list every pod")
        by_port = {p["port"]: p for p in service["spec"].get("ports", [])}
        found[name] = (protocol, service, port)
        check(port in by_port and by_port[port].get("name") == protocol,
              f"backend {name}: dns port {port} is not Service/{service_name}'s {protocol} port "
              f"({ {p.get('name'): p['port'] for p in by_port.values()} })")
        pods = [r for r in resources if r["kind"] == "Deployment"
                and selects(service["spec"].get("selector"), r["spec"]["template"]["metadata"].get("labels"))]
        if check(pods, f"Service/{service_name}: selector {service['spec'].get('selector')} selects no Deployment"):
            for deployment in pods:
                for container in pod_spec(deployment)["containers"]:
                    path = container.get("readinessProbe", {}).get("httpGet", {}).get("path")
                    check(path == READY_PATH, f"{kn(deployment)}: readinessProbe path is {path!r}, want "
                                              f"{READY_PATH} (only ready pods belong in the DNS answer)")
        if len(failures) == before:
            ok(f"backend {name}: {backend['dns']} is headless Service/{service_name}'s {protocol} port in namespace "
               f"{namespace}, selecting {', '.join(kn(d) for d in pods)}")
    return found


def service_port_target(port, container_ports):
    target = port.get("targetPort", port.get("port"))
    return container_ports.get(target) if isinstance(target, str) else target


def check_epp(resources):
    """deploy/examples/inference-pool: the InferencePool's endpointPickerRef names the EPP's Service and one of its
    ports, which leads to [listen] epp of the ConfigMap the EPP runs with; the EPP's args, ports, gRPC health probes
    and metrics annotations agree with that ConfigMap's [listen]; its backends are the pool's pods on the pool's
    target port, spoken in the pool's appProtocol. Returns the ConfigMap's gateway.toml, or None."""
    before = len(failures)
    pools = [r for r in resources if r["kind"] == "InferencePool"]
    if not pools:
        raise Fatal(f"{rel(INFERENCE_POOL)} has no InferencePool")
    deployment = find(resources, "Deployment", EPP)
    container = next((c for c in pod_spec(deployment)["containers"] if c["name"] == "epp"), None)
    if container is None:
        raise Fatal(f"Deployment/{EPP} has no container named epp")
    pod_labels = deployment["spec"]["template"]["metadata"].get("labels", {})

    # The configuration the container runs with: args, mount, ConfigMap.
    args = container.get("args", [])
    check(args[:3] == ["epp", "--config", CONFIG_PATH],
          f"Deployment/{EPP}: args {args} must start with epp --config {CONFIG_PATH}")
    mounts = [m for m in container.get("volumeMounts", []) if m.get("mountPath") == CONFIG_DIR]
    volumes = {v["name"]: v for v in pod_spec(deployment).get("volumes", [])}
    source = None
    if check(len(mounts) == 1, f"Deployment/{EPP}: nothing is mounted at {CONFIG_DIR}"):
        check("subPath" not in mounts[0] and "subPathExpr" not in mounts[0],
              f"Deployment/{EPP}: the config mount uses subPath, which never receives ConfigMap updates")
        source = volumes.get(mounts[0]["name"], {}).get("configMap", {}).get("name")
        check(source == EPP_CONFIG_MAP,
              f"Deployment/{EPP}: {CONFIG_DIR} is mounted from {source!r}, want ConfigMap {EPP_CONFIG_MAP}")
    config_map = find(resources, "ConfigMap", EPP_CONFIG_MAP)
    text = config_map.get("data", {}).get(CONFIG_KEY)
    where = f"ConfigMap/{EPP_CONFIG_MAP} {CONFIG_KEY}"
    if text is None:
        raise Fatal(f"ConfigMap/{EPP_CONFIG_MAP} has no {CONFIG_KEY} key")
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise Fatal(f"{where} is not valid TOML: {e}") from e

    # Ports: [listen] epp and metrics, the container's named ports, the gRPC health probes, the annotations.
    listen = config.get("listen", {})
    want = {name: listen_port(listen[name], name, where) for name in EPP_PORT_NAMES if name in listen}
    check(set(want) == set(EPP_PORT_NAMES), f"{where}: [listen] must set {', '.join(EPP_PORT_NAMES)}")
    ports = named_container_ports(container)
    check(ports == want, f"Deployment/{EPP}: container ports {ports} differ from {where} [listen] {want}")
    for probe, service in EPP_HEALTH.items():
        grpc = container.get(probe, {}).get("grpc")
        check(grpc == {"port": want.get("epp"), "service": service},
              f"Deployment/{EPP}: {probe} is {container.get(probe)}, want grpc: {{port: {want.get('epp')}, "
              f"service: {service}}} (grpc.health.v1 on [listen] epp)")
    annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
    check(annotations.get("prometheus.io/scrape") == "true"
          and annotations.get("prometheus.io/port") == str(want.get("metrics"))
          and annotations.get("prometheus.io/path") == "/metrics",
          f"Deployment/{EPP}: prometheus.io annotations {annotations} must scrape /metrics on [listen] metrics")

    # The EPP's Service: selects its pods, and its ports lead to [listen] epp over HTTP/2.
    service = find(resources, "Service", EPP)
    check(selects(service["spec"].get("selector"), pod_labels),
          f"Service/{EPP}: selector {service['spec'].get('selector')} does not select the EPP's pods {pod_labels}")
    service_ports = {p["port"]: p for p in service["spec"].get("ports", [])}
    for number, port in service_ports.items():
        target = service_port_target(port, ports)
        check(target == want.get("epp"), f"Service/{EPP}: port {number} goes to {target}, want [listen] epp "
                                         f"{want.get('epp')}")
        check(port.get("appProtocol") in EPP_SERVICE_APP_PROTOCOLS,
              f"Service/{EPP}: port {number} needs appProtocol {' or '.join(EPP_SERVICE_APP_PROTOCOLS)} "
              "(ext_proc is gRPC)")

    # The EPP's backends: the pods of deploy/examples/model-servers behind their headless Service.
    backends = check_fleet(resources, config, where, INFERENCE_POOL)
    check(backends, f"{where}: no backend is found by dns; the EPP needs the pool's pods as its endpoints")
    deployments = [r for r in resources if r["kind"] == "Deployment"]

    for pool in pools:
        spec = pool.get("spec") or {}
        name = f"InferencePool/{pool['metadata']['name']}"
        ref = spec.get("endpointPickerRef") or {}
        # The pool's endpoint picker is this EPP's Service, on one of that Service's ports (not a target port).
        check(ref.get("group", "") == "" and ref.get("kind", "Service") == "Service" and ref.get("name") == EPP,
              f"{name}: endpointPickerRef {ref} must name Service/{EPP} (group \"\", kind Service)")
        ref_port = (ref.get("port") or {}).get("number")
        check(ref_port in service_ports,
              f"{name}: endpointPickerRef port {ref_port} is not a port of Service/{EPP} ({sorted(service_ports)})")
        check(pool["metadata"].get("namespace") == service["metadata"].get("namespace"),
              f"{name}: in namespace {pool['metadata'].get('namespace')}, Service/{EPP} in "
              f"{service['metadata'].get('namespace')}; an endpointPickerRef is local")
        # The pool's pods, target ports and protocol are the EPP's backends'.
        selector = (spec.get("selector") or {}).get("matchLabels")
        members = [d for d in deployments if selects(selector, d["spec"]["template"]["metadata"].get("labels"))]
        check(members and all(d["metadata"]["name"] != EPP for d in members),
              f"{name}: selector {selector} must select the model servers' pods (it selects "
              f"{[kn(d) for d in members]})")
        targets = [p.get("number") for p in spec.get("targetPorts") or []]
        for member in members:
            declared = {p["containerPort"] for c in pod_spec(member)["containers"] for p in c.get("ports", [])}
            check(set(targets) <= declared,
                  f"{name}: targetPorts {targets} are not all container ports of {kn(member)} ({sorted(declared)})")
        app_protocol = spec.get("appProtocol", "http")
        for backend, (protocol, backend_service, port) in backends.items():
            check(backend_service["spec"].get("selector") == selector,
                  f"{name}: selector {selector} differs from that of Service/{backend_service['metadata']['name']} "
                  f"({backend_service['spec'].get('selector')}), which gives the EPP backend {backend} its endpoints")
            check(port in targets, f"{name}: targetPorts {targets} lack the EPP backend {backend}'s port {port}; "
                                   "the EPP would pick endpoints outside the pool")
            check(POOL_APP_PROTOCOL.get(protocol) == app_protocol,
                  f"{name}: appProtocol {app_protocol}, but the EPP backend {backend} speaks {protocol} "
                  f"(want {POOL_APP_PROTOCOL.get(protocol)})")
    if len(failures) == before:
        ok(f"Deployment/{EPP}: epp --config {CONFIG_PATH} from ConfigMap/{EPP_CONFIG_MAP}, ports {want} as in "
           "[listen], gRPC health probes liveness and readiness on epp, metrics annotations")
        ok(f"{', '.join(kn(p) for p in pools)}: endpointPickerRef is Service/{EPP} port "
           f"{', '.join(str(p['spec']['endpointPickerRef']['port']['number']) for p in pools)} -> [listen] epp; "
           "selector, targetPorts and appProtocol match the EPP's backends")
    return text


def hostnames_intersect(a, b):
    """Whether two routes' hostname lists can match the same host (an empty list matches every host)."""
    def covers(pattern, host):
        return pattern == host or (pattern.startswith("*.") and host.endswith(pattern[1:]))
    if not a or not b:
        return True
    return any(covers(x, y) or covers(y, x) for x in a for y in b)


def check_routes(resources):
    """Every HTTPRoute and GRPCRoute backendRef to an InferencePool names one of the example (same namespace, no
    port: a pool's traffic goes where its EPP says), and an HTTPRoute and a GRPCRoute sharing a parent do not
    share a hostname (Gateway API accepts only one of them then)."""
    before = len(failures)
    pools = {(p["metadata"].get("namespace"), p["metadata"]["name"]) for p in resources if p["kind"] == "InferencePool"}
    routes = [r for r in resources if r["kind"] in ("HTTPRoute", "GRPCRoute")]
    check({r["kind"] for r in routes} == {"HTTPRoute", "GRPCRoute"},
          f"{rel(INFERENCE_POOL)} needs an HTTPRoute and a GRPCRoute to its InferencePool")
    for route in routes:
        namespace = route["metadata"].get("namespace")
        refs = [ref for rule in route.get("spec", {}).get("rules") or [] for ref in rule.get("backendRefs") or []]
        to_pools = [ref for ref in refs if ref.get("group") == INFERENCE_GROUP and ref.get("kind") == "InferencePool"]
        check(to_pools, f"{kn(route)}: no backendRef to an InferencePool (group {INFERENCE_GROUP})")
        for ref in to_pools:
            check((ref.get("namespace", namespace), ref.get("name")) in pools,
                  f"{kn(route)}: backendRef to InferencePool/{ref.get('name')} in namespace "
                  f"{ref.get('namespace', namespace)}, which {rel(INFERENCE_POOL)} does not have")
            check("port" not in ref, f"{kn(route)}: backendRef to InferencePool/{ref.get('name')} sets a port, "
                                     "which an InferencePool backend ignores; leave it out")
    for http in (r for r in routes if r["kind"] == "HTTPRoute"):
        for grpc in (r for r in routes if r["kind"] == "GRPCRoute"):
            shared = [p for p in http.get("spec", {}).get("parentRefs") or []
                      if p in (grpc.get("spec", {}).get("parentRefs") or [])]
            check(not shared or not hostnames_intersect(http["spec"].get("hostnames"), grpc["spec"].get("hostnames")),
                  f"{kn(http)} and {kn(grpc)} share parent {shared} and hostnames; Gateway API accepts only one")
    if len(failures) == before:
        ok(f"{', '.join(kn(r) for r in routes)}: backendRefs name the example's InferencePool; hostnames disjoint")


def secret_value(secret, key):
    """A Secret's value at `key`, from stringData or (base64) data; None when it has none."""
    if key in (secret.get("stringData") or {}):
        return str(secret["stringData"][key])
    if key in (secret.get("data") or {}):
        return base64.b64decode(secret["data"][key]).decode("utf-8", "replace")
    return None


def secret_env(container):
    """{env var: (Secret, key)} for the container's env vars that come from a Secret."""
    refs = {}
    for var in container.get("env") or []:
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            refs[var.get("name")] = (ref.get("name"), ref.get("key"))
    return refs


def check_shared_limits(resources, base_config):
    """deploy/examples/shared-limits: its gateway.toml is config/gateway.toml plus [limits.shared] and [auth]; the
    Redis URL there names the Redis Service, on a port leading to the one Redis pod, without a password; the gateway's
    OIPGATE__LIMITS__SHARED__REDIS comes from a Secret whose URL names the same Redis with the password Redis starts
    with, also from a Secret; Redis keeps nothing on disk; NetworkPolicies let only the gateway's pods reach it.
    Returns (gateway.toml, its parsed form, the Secret's URL or None)."""
    before = len(failures)
    config_map = find(resources, "ConfigMap", CONFIG_MAP)
    text = config_map.get("data", {}).get(CONFIG_KEY)
    where = f"ConfigMap/{CONFIG_MAP} {CONFIG_KEY} of {rel(SHARED_LIMITS)}"
    if text is None:
        raise Fatal(f"{where} is missing")
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise Fatal(f"{where} is not valid TOML: {e}") from e
    shared = (config.get("limits") or {}).get("shared")
    if not isinstance(shared, dict) or not isinstance(shared.get("redis"), str):
        raise Fatal(f"{where} has no [limits.shared] redis")

    # The example changes what it shows and nothing else, so it cannot drift from the base configuration.
    rest = copy.deepcopy(config)
    del rest["limits"]["shared"]
    rest.pop("auth", None)
    check(rest == base_config, f"{where}: apart from [limits.shared] and [auth] it differs from config/gateway.toml; "
                               "keep the rest the same")
    check(any(key.get("rate") for key in (config.get("auth") or {}).get("api_keys") or []),
          f"{where}: no [[auth.api_keys]] principal has a rate for the replicas to share")

    # The URL the ConfigMap names: the Redis Service, no password (that comes from the Secret, below).
    url = urlsplit(shared["redis"])
    check(url.username is None and url.password is None,
          f"{where}: [limits.shared] redis carries credentials; they belong in a Secret ({REDIS_URL_ENV}), not in a "
          "ConfigMap")
    match = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local\.?", url.hostname or "")
    if not match:
        raise Fatal(f"{where}: [limits.shared] redis host {url.hostname!r} is not "
                    "<service>.<namespace>.svc.cluster.local")
    service = find(resources, "Service", match.group(1))
    check(service["metadata"].get("namespace", "default") == match.group(2),
          f"{where}: [limits.shared] redis names namespace {match.group(2)}, but Service/{match.group(1)} is in "
          f"{service['metadata'].get('namespace', 'default')}")
    port = url.port or 6379
    service_port = next((p for p in service["spec"].get("ports", []) if p["port"] == port), None)
    if service_port is None:
        raise Fatal(f"{where}: [limits.shared] redis port {port} is not a port of {kn(service)}")
    deployments = [r for r in resources if r["kind"] == "Deployment"]
    selected = [d for d in deployments if selects(service["spec"].get("selector"), d["spec"]["template"]["metadata"]
                                                  .get("labels"))]
    if len(selected) != 1:
        raise Fatal(f"{kn(service)}: selects {[kn(d) for d in selected]}, want the one Redis Deployment")
    redis = selected[0]
    check(redis["spec"].get("replicas", 1) == 1, f"{kn(redis)}: {redis['spec'].get('replicas')} replicas; each "
                                                  "would keep a budget of its own")
    container = next((c for c in pod_spec(redis)["containers"]
                      if service_port_target(service_port, named_container_ports(c))
                      in {p["containerPort"] for p in c.get("ports", [])}), None)
    if container is None:
        raise Fatal(f"{kn(service)}: port {port} leads to no container port of {kn(redis)}")
    redis_port = service_port_target(service_port, named_container_ports(container))

    # Redis: no persistence, and its password from a Secret, passed through the environment.
    command_line = " ".join(container.get("command", []) + container.get("args", []))
    check(re.search(r"--save (\"\"|'')(\s|$)", command_line) and re.search(r"--appendonly no\b", command_line),
          f"{kn(redis)}: Redis must run with --save \"\" --appendonly no (limits need no persistence)")
    redis_secrets = {name: ref for name, ref in secret_env(container).items()
                     if re.search(rf"\$\(?{re.escape(name)}\b", command_line)}
    check(len(redis_secrets) == 1, f"{kn(redis)}: Redis must start with its password from a Secret, through one "
                                   "env var with a secretKeyRef that its command line uses")
    password = None
    for secret_name, key in redis_secrets.values():
        password = secret_value(find(resources, "Secret", secret_name), key)
        check(password, f"Secret/{secret_name} has no {key} for {kn(redis)}'s password")

    # The gateway: its URL, password included, from a Secret; the same Redis as the ConfigMap's, the same password.
    gateway = find(resources, "Deployment", GATEWAY)
    gateway_container = next(c for c in pod_spec(gateway)["containers"] if c["name"] == GATEWAY)
    ref = secret_env(gateway_container).get(REDIS_URL_ENV)
    secret_url = None
    if check(ref, f"{kn(gateway)}: no env {REDIS_URL_ENV} from a Secret (secretKeyRef)"):
        secret_url = secret_value(find(resources, "Secret", ref[0]), ref[1])
        if check(secret_url, f"Secret/{ref[0]} has no {ref[1]} for {kn(gateway)}'s {REDIS_URL_ENV}"):
            given = urlsplit(secret_url)
            check((given.scheme, given.hostname, given.port or 6379, given.path)
                  == (url.scheme, url.hostname, port, url.path),
                  f"Secret/{ref[0]} {ref[1]}: names another Redis than [limits.shared] redis {shared['redis']}")
            check(password is None or given.password == password,
                  f"Secret/{ref[0]} {ref[1]}: its password is not the one {kn(redis)} starts with")

    # Only the gateway's pods reach Redis, on its port. Policies add up, so every one selecting Redis must say so.
    redis_labels = redis["spec"]["template"]["metadata"].get("labels")
    policies = [p for p in resources if p["kind"] == "NetworkPolicy"
                and selects((p["spec"].get("podSelector") or {}).get("matchLabels"), redis_labels)]
    check(policies, f"no NetworkPolicy selects {kn(redis)}'s pods; only the gateways should reach Redis")
    for policy in policies:
        spec = policy["spec"]
        check("Ingress" in spec.get("policyTypes", ["Ingress"]), f"{kn(policy)}: policyTypes lack Ingress")
        for rule in spec.get("ingress") or []:
            check(rule.get("from"), f"{kn(policy)}: an ingress rule without `from` admits every source")
            for peer in rule.get("from") or []:
                selector = peer.get("podSelector") or {}
                admitted = [kn(d) for d in deployments
                            if selects(selector.get("matchLabels"), d["spec"]["template"]["metadata"].get("labels"))]
                check(set(peer) == {"podSelector"} and set(selector) == {"matchLabels"}
                      and admitted == [kn(gateway)],
                      f"{kn(policy)}: ingress from {peer} admits {admitted or 'more than the example'}, want the "
                      f"pods of {kn(gateway)} alone (a podSelector with matchLabels, no namespaceSelector or ipBlock)")
            ports = rule.get("ports") or []
            check(ports and all(p.get("protocol", "TCP") == "TCP"
                                and p.get("port") in (redis_port, service_port.get("targetPort")) for p in ports),
                  f"{kn(policy)}: ingress ports {ports}, want TCP {redis_port} alone")
    if len(failures) == before:
        ok(f"{where}: config/gateway.toml plus [limits.shared] and a principal with a rate; redis "
           f"{shared['redis']} is {kn(service)} port {port} -> {kn(redis)} ({container['image']}, 1 replica, no "
           "persistence), no password in it")
        ok(f"{kn(gateway)}: {REDIS_URL_ENV} from Secret/{ref[0]} {ref[1]}, the same Redis with the password "
           f"{kn(redis)} starts with (Secret/{next(iter(redis_secrets.values()))[0]})")
        ok(f"{', '.join(kn(p) for p in policies)}: only {kn(gateway)}'s pods reach {kn(redis)}, on TCP {redis_port}")
    return text, config, secret_url


def check_hardening(resources):
    """Every container of every Deployment runs as non-root, with RuntimeDefault seccomp, a read-only root
    filesystem, no privilege escalation and no capabilities, with readiness and liveness probes, a memory request
    and a memory limit."""
    before = len(failures)
    seen = []
    for deployment in (r for r in resources if r["kind"] == "Deployment"):
        if kn(deployment) in seen:
            continue
        seen.append(kn(deployment))
        pod = pod_spec(deployment)
        pod_security = pod.get("securityContext") or {}
        for container in pod["containers"]:
            where = f"{kn(deployment)} container {container['name']}"
            security = container.get("securityContext") or {}
            check(security.get("runAsNonRoot", pod_security.get("runAsNonRoot")) is True,
                  f"{where}: runAsNonRoot is not set")
            seccomp = security.get("seccompProfile", pod_security.get("seccompProfile")) or {}
            check(seccomp.get("type") == "RuntimeDefault", f"{where}: seccompProfile is not RuntimeDefault")
            check(security.get("readOnlyRootFilesystem") is True, f"{where}: the root filesystem is writable")
            check(security.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation is not false")
            check((security.get("capabilities") or {}).get("drop") == ["ALL"] and
                  not (security.get("capabilities") or {}).get("add"), f"{where}: capabilities must drop ALL, add none")
            check("readinessProbe" in container and "livenessProbe" in container,
                  f"{where}: needs a readinessProbe and a livenessProbe")
            resources_ = container.get("resources") or {}
            check((resources_.get("requests") or {}).get("memory") and (resources_.get("limits") or {}).get("memory"),
                  f"{where}: needs a memory request and a memory limit")
    if len(failures) == before:
        ok(f"{', '.join(seen)}: non-root, RuntimeDefault seccomp, read-only root, no privilege escalation, no "
           "capabilities, readiness and liveness probes, memory request and limit")


def oipgate_binary():
    return os.environ.get("OIPGATE_BIN", str(ROOT / "target" / "debug" / "oipgate"))


def check_command_lines(resources, dockerfile_cmd):
    """Every oipgate command line the manifests and the Dockerfile run names a subcommand and flags the binary
    has (a flag it lacks would crash-loop the pods)."""
    binary = oipgate_binary()
    lines = [("Dockerfile CMD", dockerfile_cmd)] if dockerfile_cmd else []
    seen = set()
    for deployment in (r for r in resources if r["kind"] == "Deployment"):
        if kn(deployment) in seen:
            continue
        seen.add(kn(deployment))
        for container in pod_spec(deployment)["containers"]:
            if split_image(container.get("image", ""))[0].rsplit("/", 1)[-1] == "oipgate":
                lines.append((f"{kn(deployment)} container {container['name']}",
                              container.get("command", [])[1:] + container.get("args", [])))
    for where, args in lines:
        if not check(args and not args[0].startswith("-"), f"{where}: {args} names no oipgate subcommand"):
            continue
        try:
            result = subprocess.run([binary, args[0], "--help"], capture_output=True, text=True, timeout=60)
        except OSError as e:
            fail(f"cannot run {binary}: {e} (build it, or set OIPGATE_BIN)")
            return
        if not check(result.returncode == 0, f"{where}: `oipgate {args[0]}` is not a subcommand of {binary}"):
            continue
        known = set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", result.stdout))
        unknown = [a.split("=")[0] for a in args[1:] if a.startswith("--") and a.split("=")[0] not in known]
        if check(not unknown, f"{where}: `oipgate {args[0]}` has no {', '.join(unknown)} in {binary}"):
            ok(f"{where}: oipgate {' '.join(args)}")


def check_config_accepted(text, what, overrides=None):
    """`oipgate check-config` on `text` (`what` names it), with the OIPGATE__SECTION__KEY `overrides` the pod has."""
    binary = oipgate_binary()
    with tempfile.TemporaryDirectory(prefix="deploy-check-") as tmp:
        path = Path(tmp) / CONFIG_KEY
        path.write_text(text, encoding="utf-8")
        # The file as the pod sees it: no OIPGATE__SECTION__KEY overrides from this shell, only the pod's.
        environment = {k: v for k, v in os.environ.items() if not k.upper().startswith("OIPGATE__")}
        environment.update(overrides or {})
        try:
            result = subprocess.run([binary, "check-config", str(path)], env=environment, capture_output=True,
                                    text=True, timeout=60)
        except OSError as e:
            fail(f"cannot run {binary} check-config: {e} (build it, or set OIPGATE_BIN)")
            return
    output = (result.stdout + result.stderr).strip()
    for line in output.splitlines():
        print(f"      {line}")
    if check(result.returncode == 0, f"{binary} check-config rejects {what} (exit status {result.returncode})"):
        ok(f"{binary} check-config accepts {what}")


def dockerfile_instructions(path):
    """(instruction, arguments) of the final stage, continuation lines joined, comments dropped."""
    stages, logical, pending = [], [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    for line in logical:
        instruction, _, arguments = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            stages.append([])
        elif stages:
            stages[-1].append((instruction, arguments.strip()))
    if not stages:
        raise Fatal("Dockerfile has no FROM")
    return stages[-1]


def exec_form(arguments):
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) else None


def check_dockerfile(gateway_pod):
    """Checks the final stage; returns its CMD (exec form) or None."""
    final = dockerfile_instructions(DOCKERFILE)
    before = len(failures)
    exposed = set()
    for instruction, arguments in final:
        if instruction == "EXPOSE":
            exposed |= {p.split("/")[0] for p in arguments.split()}
    check({"8000", "8001", "8002"} <= exposed, f"Dockerfile: the final stage exposes {sorted(exposed)}, "
                                               "want EXPOSE 8000 8001 8002")
    users = [arguments for instruction, arguments in final if instruction == "USER"]
    user = users[-1].split(":")[0] if users else None
    check(user is not None and user not in ("0", "root"), f"Dockerfile: the final stage runs as {user or 'root'}; "
                                                          "it needs a non-root USER")
    run_as = gateway_pod.get("securityContext", {}).get("runAsUser")
    check(user is None or not user.isdigit() or int(user) == run_as,
          f"Dockerfile: USER {user} differs from the Deployment's runAsUser {run_as}")
    commands = [exec_form(a) for i, a in final if i == "CMD"]
    entrypoints = [exec_form(a) for i, a in final if i == "ENTRYPOINT"]
    check(commands and commands[-1] == ["serve", "--config", CONFIG_PATH],
          f"Dockerfile: CMD must be [\"serve\", \"--config\", \"{CONFIG_PATH}\"] (exec form)")
    check(entrypoints and entrypoints[-1] and Path(entrypoints[-1][0]).name == "oipgate",
          "Dockerfile: ENTRYPOINT must run oipgate (exec form)")
    copies = [a.split()[-2:] for i, a in final if i == "COPY"]
    check(["config/gateway.toml", CONFIG_PATH] in copies,
          f"Dockerfile: the final stage must COPY config/gateway.toml {CONFIG_PATH}")
    if len(failures) == before:
        ok(f"Dockerfile: EXPOSE {' '.join(sorted(exposed))}, USER {users[-1]}, ENTRYPOINT {entrypoints[-1]}, "
           f"CMD {commands[-1]}, config/gateway.toml at {CONFIG_PATH}")
    return commands[-1] if commands else None


def main():
    config_text = CONFIG.read_text(encoding="utf-8")
    try:
        config = tomllib.loads(config_text)
    except tomllib.TOMLDecodeError as e:
        raise Fatal(f"config/gateway.toml is not valid TOML: {e}") from e

    section(f"CustomResourceDefinitions in {rel(CRDS)} (upstream copies)")
    crds = load_crds()

    # Every kustomization under deploy/ renders and validates, and every manifest belongs to one.
    directories = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))
    rendered = {}
    for directory in directories:
        section(f"render {rel(directory)} and validate against Kubernetes {KUBERNETES_VERSION} and {rel(CRDS)} "
                "(strict)")
        rendered[directory] = render(directory)
        validate(rendered[directory], crds)
    for manifest in sorted(list(DEPLOY.rglob("*.yaml")) + list(DEPLOY.rglob("*.yml"))):
        if manifest.parent.resolve() == CRDS.resolve():
            continue
        if not (manifest.parent / "kustomization.yaml").is_file():
            fail(f"{rel(manifest)} is in no kustomization's directory, so nothing applies or checks it")
    for required in (BASE, WITH_MODEL_SERVERS, INFERENCE_POOL, SHARED_LIMITS):
        if required not in rendered:
            raise Fatal(f"{rel(required)}/kustomization.yaml is missing")

    section(f"the CEL rules of {rel(CRDS)}, on mutations of {rel(INFERENCE_POOL)}'s resources")
    check_cel_rules(rendered[INFERENCE_POOL], crds)

    section(f"gateway manifests in {rel(BASE)} against config/gateway.toml")
    check_gateway(rendered[BASE], config, config_text)

    section(f"backends reached by DNS in {rel(WITH_MODEL_SERVERS)}")
    check_fleet(rendered[WITH_MODEL_SERVERS], config)

    section(f"the endpoint picker of {rel(INFERENCE_POOL)} against its ConfigMap and the InferencePool")
    check_epp(rendered[INFERENCE_POOL])

    section(f"routes of {rel(INFERENCE_POOL)}")
    check_routes(rendered[INFERENCE_POOL])

    section(f"the Redis of {rel(SHARED_LIMITS)} against its gateway configuration, Secret and NetworkPolicy")
    shared_text, shared_config, shared_url = check_shared_limits(rendered[SHARED_LIMITS], config)
    check_fleet(rendered[SHARED_LIMITS], shared_config, f"ConfigMap/{CONFIG_MAP} of {rel(SHARED_LIMITS)}",
                SHARED_LIMITS)

    every_resource = [resource for resources in rendered.values() for resource in resources]
    section("hardening of every Deployment's containers")
    check_hardening(every_resource)

    # Every ConfigMap that carries a configuration, in any kustomization; each text once.
    section(f"oipgate accepts every ConfigMap's {CONFIG_KEY}")
    checked = set()
    for directory, resources in rendered.items():
        for config_map in (r for r in resources if r["kind"] == "ConfigMap"):
            text = (config_map.get("data") or {}).get(CONFIG_KEY)
            if text is not None and text not in checked:
                checked.add(text)
                check_config_accepted(text, f"{kn(config_map)} {CONFIG_KEY} of {rel(directory)}")
    if shared_url is not None:
        check_config_accepted(shared_text, f"{kn(find(rendered[SHARED_LIMITS], 'ConfigMap', CONFIG_MAP))} "
                                           f"{CONFIG_KEY} of {rel(SHARED_LIMITS)} with its Secret's {REDIS_URL_ENV}",
                              {REDIS_URL_ENV: shared_url})

    section("Dockerfile")
    dockerfile_cmd = check_dockerfile(pod_spec(find(rendered[BASE], "Deployment", GATEWAY)))

    section("oipgate command lines in the manifests and the Dockerfile")
    check_command_lines(every_resource, dockerfile_cmd)


if __name__ == "__main__":
    try:
        main()
    except Fatal as e:
        fail(str(e))
        print("deploy-check: stopped at the first problem above; the checks after it did not run")
        sys.exit(1)
    if failures:
        print(f"deploy-check: {len(failures)} check(s) failed")
        sys.exit(1)
    print("deploy-check: all checks passed")
