# The CEL rules of a CRD's schema (x-kubernetes-validations) evaluated as the API server evaluates them on create.
"""A custom resource is defaulted as its schema says (the API server's structural defaulting, which runs before
validation), then each rule is evaluated with `self` bound to the value of the node it stands on, wherever that value
is present, by cel-python (CEL's standard functions and macros, with RE2 for `matches`, as Kubernetes has). A rule
that names `oldSelf` compares an update with what it replaces, so it does not apply to a resource being created; it
is counted, not evaluated. A rule that cannot be evaluated (a function this evaluator lacks, a field it reads that is
absent) is a failure, never a pass.
"""

import copy
import re

import celpy
import celpy.celtypes

_OLD_SELF = re.compile(r"\boldSelf\b")


class Rules:
    """Compiles each rule once, and evaluates the rules of one schema over resources."""

    def __init__(self, schema):
        self.schema = schema
        self.environment = celpy.Environment()
        self.programs = {}
        self.evaluated, self.on_update = 0, 0
        self._count(schema)

    def _count(self, schema):
        if not isinstance(schema, dict):
            return
        for rule in schema.get("x-kubernetes-validations", []):
            if _OLD_SELF.search(rule["rule"]):
                self.on_update += 1
            else:
                self.evaluated += 1
        for sub in (schema.get("properties") or {}).values():
            self._count(sub)
        for key in ("items", "additionalProperties"):
            self._count(schema.get(key))

    def failures(self, document):
        """Each rule `document` breaks, as `field: message (rule: ...)`, once defaulted as the API server would."""
        found = []
        resource = defaulted(self.schema, copy.deepcopy(document))
        # Of an object's metadata, CEL sees only its name and generateName.
        metadata = resource.get("metadata") or {}
        resource["metadata"] = {key: metadata[key] for key in ("name", "generateName") if key in metadata}
        self._walk(self.schema, resource, "", found)
        return found

    def _walk(self, schema, value, path, found):
        if not isinstance(schema, dict) or value is None:
            return
        for rule in schema.get("x-kubernetes-validations", []):
            text = rule["rule"]
            if _OLD_SELF.search(text):
                continue
            where = (path or "(top level)") + (rule.get("fieldPath") or "")
            message = rule.get("message") or rule.get("messageExpression") or "failed rule"
            try:
                program = self.programs.get(text)
                if program is None:
                    program = self.programs[text] = self.environment.program(self.environment.compile(text))
                result = program.evaluate({"self": celpy.json_to_cel(value)})
            except Exception as e:  # noqa: BLE001 - a rule that cannot be evaluated is not passed
                found.append(f"{where}: rule could not be evaluated ({type(e).__name__}: {e}) (rule: {text})")
                continue
            if isinstance(result, celpy.CELEvalError):
                found.append(f"{where}: rule could not be evaluated ({result}) (rule: {text})")
            elif not isinstance(result, celpy.celtypes.BoolType) or not result:
                found.append(f"{where}: {message} (rule: {text})")
        if isinstance(value, dict):
            properties = schema.get("properties") or {}
            for name, sub in properties.items():
                if name in value:
                    self._walk(sub, value[name], f"{path}.{name}" if path else name, found)
            additional = schema.get("additionalProperties")
            if isinstance(additional, dict):
                for name, item in value.items():
                    if name not in properties:
                        self._walk(additional, item, f"{path}[{name!r}]", found)
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for index, item in enumerate(value):
                self._walk(schema["items"], item, f"{path}[{index}]", found)


def defaulted(schema, value):
    """`value` with the defaults of `schema` filled in where a field is absent, in place, at every depth (a default
    is itself defaulted); returns `value`."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        for name, sub in properties.items():
            if name not in value and isinstance(sub, dict) and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                defaulted(sub, value[name])
        additional = schema.get("additionalProperties")
        if isinstance(additional, dict):
            for name in value:
                if name not in properties:
                    defaulted(additional, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            defaulted(schema["items"], item)
    return value
