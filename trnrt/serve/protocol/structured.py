"""Structured-output fields of every API -> one GrammarSpec (or None). Pure Python.

Spellings read (exactly one constraint per request, else a 400):
- OpenAI `response_format`: {"type": "text"} (none), "json_object", "json_schema" (with
  `json_schema.schema`, `name`, `strict` a bool), "structural_tag" (SGLang's, the tag object).
- vLLM `structured_outputs`: {json, regex, choice, grammar, json_object, structural_tag} plus
  `disable_any_whitespace` (compact JSON); its other options are ignored with a warning.
- vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (served:
  vLLM 0.33 dropped them silently, which gives unconstrained output; here they constrain).
- SGLang: `json_schema` (JSON text), `regex`, `ebnf`, `structural_tag` (JSON text) in
  /generate's sampling_params and at the top level of the OpenAI routes.
- Responses `text.format`: {"type": "json_schema", "schema", "name", "strict"} / "json_object".

Compiling happens in the engine's submit (trnrt.engine.sample.grammar): a grammar error is a 400 naming
the field given here as GrammarSpec.param. The `</think>` gate is set by the chat handlers.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from trnrt.engine.sample.grammar_spec import GrammarSpec
from trnrt.serve.http.errors import bad_request, safe
from trnrt.serve.protocol.fields import ErrorFactory, check_unicode_tree, is_text

log = logging.getLogger("trnrt.serve")

ONE_CONSTRAINT = "Only one of json_schema, regex, ebnf, or structural_tag can be set."
# Every top-level field an OpenAI route reads here (so the unserved-field table skips them).
OPENAI_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "regex", "ebnf", "json_schema", "structural_tag")
SGLANG_SAMPLING_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
_VLLM_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_VLLM_SO_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                    "disable_fallback", "backend")


def _schema_text(v: Any, label: str, err: ErrorFactory) -> str:
    """A JSON schema given as an object (or as JSON text) -> JSON text."""
    if isinstance(v, bool) or not isinstance(v, (dict, str)):
        raise err(f"{label} must be a JSON schema object", label)
    if isinstance(v, str):
        if not is_text(v):
            raise err(f"{label} is not valid Unicode (it holds a lone surrogate)", label)
        return v
    check_unicode_tree(v, label, err)
    return json.dumps(v, ensure_ascii=False)


def _str_value(v: Any, label: str, err: ErrorFactory) -> str:
    if not isinstance(v, str) or not v:
        raise err(f"{label} must be a non-empty string", label)
    if not is_text(v):
        raise err(f"{label} is not valid Unicode (it holds a lone surrogate)", label)
    return v


def _tag_text(v: Any, label: str, err: ErrorFactory) -> str:
    if isinstance(v, dict):
        check_unicode_tree(v, label, err)
        return json.dumps(v, ensure_ascii=False)
    return _str_value(v, label, err)


def _choice(v: Any, label: str, err: ErrorFactory) -> str:
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c and is_text(c) for c in v):
        raise err(f"{label} must be a non-empty list of non-empty strings", label)
    return json.dumps(v, ensure_ascii=False)


def _response_format(rf: Any, label: str, err: ErrorFactory) -> GrammarSpec | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise err(f"{label} must be an object with a type", label)
    t = rf["type"]
    if t == "text":
        return None
    if t == "json_object":
        return GrammarSpec("json_object", "", label)
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise err(f"{label}.json_schema must be an object with a schema", f"{label}.json_schema")
        return _json_schema_obj(js, f"{label}.json_schema", err)
    if t == "structural_tag":
        tag = {k: v for k, v in rf.items()}
        return GrammarSpec("structural_tag", _tag_text(tag, label, err), label)
    raise err(f"{label}.type must be one of text, json_object, json_schema, structural_tag, got "
              f"{safe(repr(t))}", f"{label}.type")


def _json_schema_obj(js: dict, label: str, err: ErrorFactory) -> GrammarSpec:
    """{schema, name, strict, description} (OpenAI's json_schema object; Responses' text.format)."""
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise err(f"{label}.strict must be a boolean", f"{label}.strict")
    if js.get("name") is not None and not isinstance(js["name"], str):
        raise err(f"{label}.name must be a string", f"{label}.name")
    schema = js.get("schema")
    if schema is None:
        schema = {"type": "object"}  # OpenAI: a json_schema without a schema is any object
    return GrammarSpec("json_schema", _schema_text(schema, f"{label}.schema", err), f"{label}.schema")


def _vllm_structured(so: Any, err: ErrorFactory) -> list[GrammarSpec]:
    label = "structured_outputs"
    if not isinstance(so, dict):
        raise err(f"{label} must be an object", label)
    unknown = [k for k in so if k not in _VLLM_SO_KEYS + _VLLM_SO_OPTIONS]
    if unknown:
        log.warning("ignoring unknown structured_outputs fields: %s", ", ".join(safe(repr(k)) for k in unknown[:8]))
    for k in ("disable_additional_properties", "whitespace_pattern", "disable_fallback", "backend"):
        if so.get(k) not in (None, False, ""):
            log.warning("ignoring structured_outputs.%s (xgrammar's defaults apply)", k)
    compact = so.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise err(f"{label}.disable_any_whitespace must be a boolean", f"{label}.disable_any_whitespace")
    out = []
    for k in _VLLM_SO_KEYS:
        v = so.get(k)
        if v is None or (k == "json_object" and v is False):
            continue
        lab = f"{label}.{k}"
        if k == "json":
            out.append(GrammarSpec("json_schema", _schema_text(v, lab, err), lab, any_whitespace=not compact))
        elif k == "json_object":
            if v is not True:
                raise err(f"{lab} must be a boolean", lab)
            out.append(GrammarSpec("json_object", "", lab, any_whitespace=not compact))
        elif k == "regex":
            out.append(GrammarSpec("regex", _str_value(v, lab, err), lab))
        elif k == "choice":
            out.append(GrammarSpec("choice", _choice(v, lab, err), lab))
        elif k == "grammar":
            out.append(GrammarSpec("ebnf", _str_value(v, lab, err), lab))
        else:
            out.append(GrammarSpec("structural_tag", _tag_text(v, lab, err), lab))
    if not out:  # vLLM refuses a structured_outputs that constrains nothing, as here
        raise err(f"{label} must set one of {', '.join(_VLLM_SO_KEYS)}", label)
    return out


def read_openai(body: dict, *, sglang_keys=("regex", "ebnf"), err: ErrorFactory = bad_request) -> GrammarSpec | None:
    """The structured output of a /v1/chat/completions or /v1/completions body (None: none).
    sglang_keys: SGLang's top-level spellings the route knows (chat: regex, ebnf; completions
    also json_schema)."""
    found: list[GrammarSpec] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"], "response_format", err)
        if spec is not None:
            found.append(spec)
    if body.get("structured_outputs") is not None:
        found += _vllm_structured(body["structured_outputs"], err)
    if body.get("guided_json") is not None:
        found.append(GrammarSpec("json_schema", _schema_text(body["guided_json"], "guided_json", err), "guided_json"))
    if body.get("guided_regex") is not None:
        found.append(GrammarSpec("regex", _str_value(body["guided_regex"], "guided_regex", err), "guided_regex"))
    if body.get("guided_choice") is not None:
        found.append(GrammarSpec("choice", _choice(body["guided_choice"], "guided_choice", err), "guided_choice"))
    if body.get("guided_grammar") is not None:
        found.append(GrammarSpec("ebnf", _str_value(body["guided_grammar"], "guided_grammar", err), "guided_grammar"))
    found += read_sglang({k: body.get(k) for k in sglang_keys}, "", err=err)
    if len(found) > 1:
        raise err(f"{ONE_CONSTRAINT} Got {', '.join(s.param for s in found)}", found[1].param)
    return found[0] if found else None


def read_sglang(sp: dict, label: str, *, err: ErrorFactory) -> list[GrammarSpec]:
    """SGLang's json_schema (JSON text) / regex / ebnf / structural_tag (JSON text) of a
    sampling_params dict (label "sampling_params." ...; "" for the OpenAI routes' top level)."""
    out = []
    for k in SGLANG_SAMPLING_FIELDS:
        v = sp.get(k)
        if v is None:
            continue
        lab = f"{label}{k}"
        if k == "json_schema":
            out.append(GrammarSpec("json_schema", _schema_text(v, lab, err), lab))
        elif k == "structural_tag":
            out.append(GrammarSpec("structural_tag", _tag_text(v, lab, err), lab))
        else:
            out.append(GrammarSpec("regex" if k == "regex" else "ebnf", _str_value(v, lab, err), lab))
    return out


def read_sglang_one(sp: dict, label: str, *, err: ErrorFactory) -> GrammarSpec | None:
    found = read_sglang(sp, label, err=err)
    if len(found) > 1:
        raise err(ONE_CONSTRAINT, found[1].param)
    return found[0] if found else None


def read_text_format(fmt: dict, *, err: ErrorFactory = bad_request) -> GrammarSpec | None:
    """Responses `text.format`: text (None), json_object, json_schema {schema, name, strict}."""
    t = fmt.get("type")
    if t == "text":
        return None
    if t == "json_object":
        return GrammarSpec("json_object", "", "text.format")
    if t == "json_schema":
        return _json_schema_obj(fmt, "text.format", err)
    raise err(f"text.format.type must be 'text', 'json_schema' or 'json_object', got {safe(repr(t))}", "text.format")


def gate_after_think(spec: GrammarSpec | None, think_end_id: int | None, reasons: bool) -> GrammarSpec | None:
    """The grammar applies after `</think>` when the request reasons (a chat template that opens a
    think block): set its gate to the `</think>` id read from the tokenizer."""
    if spec is None or not reasons or think_end_id is None:
        return spec
    return spec.with_after_token(think_end_id)
