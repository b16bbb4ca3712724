"""Chat templates of a Hugging Face model folder: where they are read from (transformers'
precedence) and how they are compiled (transformers' sandboxed jinja2 environment). Rendering
them with a request's messages is `layerzoo.tokenization.tokenizer.Tokenizer.apply_chat_template`."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from layerzoo.errors import ConfigError
from layerzoo.loading.hf_files import one_line, read_json_object

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "chat_templates"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"


def load_chat_templates(model_dir: Path, tok_config: dict, tok_config_path: Path) -> tuple[dict[str, str], str]:
    """The chat templates by name, and where they came from (for error messages).

    Same precedence as transformers: chat_template.jinja and chat_templates/*.jinja override the
    `chat_template` key of tokenizer_config.json; chat_template.json (the processor file) is the
    last resort.
    """
    templates: dict[str, str] = {}
    jinja_path = model_dir / CHAT_TEMPLATE_FILE
    template_dir = model_dir / CHAT_TEMPLATE_DIR
    if jinja_path.is_file():
        templates["default"] = read_text(jinja_path)
    if template_dir.is_dir():
        for path in sorted(template_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = read_text(path)
    if templates:
        source = str(jinja_path) if jinja_path.is_file() else str(template_dir)
        return templates, source

    if "chat_template" in tok_config and tok_config["chat_template"] is not None:
        return parse_template_value(tok_config["chat_template"], tok_config_path), str(tok_config_path)

    legacy_path = model_dir / LEGACY_CHAT_TEMPLATE_FILE
    if legacy_path.is_file():
        data = read_json_object(legacy_path)
        if data.get("chat_template") is not None:
            return parse_template_value(data["chat_template"], legacy_path), str(legacy_path)
    return {}, str(model_dir)


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read ({one_line(exc)})") from None


def parse_template_value(value: Any, path: Path) -> dict[str, str]:
    """`chat_template` as stored in a JSON file: a string, or a list of {"name", "template"}."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return dict(value)
    if isinstance(value, list):
        templates = {}
        for item in value:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)):
                raise ConfigError(
                    f'{path}: "chat_template" list entries must be {{"name": str, "template": str}}, got {item!r}'
                )
            templates[item["name"]] = item["template"]
        return templates
    raise ConfigError(
        f'{path}: "chat_template" must be a string or a list of {{"name", "template"}} objects, '
        f"got {type(value).__name__}"
    )


def compile_template(template: str):
    """Compile a chat template in the same sandboxed environment transformers uses."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # transformers' `{% generation %}...{% endgeneration %}` marks assistant text; rendering is unchanged.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Unlike jinja's own tojson: no HTML escaping, and the json.dumps options exposed.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Reject dunder/underscore attributes so templates cannot reach interpreter internals.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
