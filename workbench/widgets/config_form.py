"""An ipywidgets form generated from the run-config dataclasses.

Why generated: :mod:`workbench.config` is the single source of truth, so every field (its
type, its ``Literal`` options, its default) comes from ``dataclasses.fields`` and the type
hints; a new config field appears in the form without touching this file.  Every change
rebuilds the :class:`RunConfig`, re-runs ``validate()`` and shows each problem next to the
field it names, refreshes the memory-planner readout, and keeps export / launch in step.

The form shows the fields that apply: a field one model family owns (``Family.fields``) only for
that family, a GPU-only field (:data:`workbench.kernel_rule.GPU_ONLY_FIELDS`) only on ``device: cuda``;
a hidden field that has a problem shows again, next to its message.

A nested section (a dataclass field such as ``model.moe``) gets a widget per field too
(``model.moe.top_k``), in a collapsible group of its own under its section's tab.  A group with a
switch (:data:`GROUP_SWITCHES`: MoE's ``num_experts``, 0 for a dense MLP) is labelled optional and
starts collapsed while the switch is off, showing only the switch; its other fields appear when it is on.
"""

from __future__ import annotations

import dataclasses
import html
import json
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, get_args, get_origin, get_type_hints

from workbench import planner
from workbench.config import PRESETS, ConfigError, DatasetEntry, Problem, RunConfig, preset
from workbench.kernel_rule import GPU_ONLY_FIELDS
from workbench.families import FAMILIES
from workbench.launch import Run
from workbench.plots.tables import Table, plan_table
from workbench.widgets.layout import plural

__all__ = ["ConfigForm", "field_specs", "FieldSpec", "GROUP_SWITCHES"]

SECTIONS = ("model", "parallel", "train", "data", "checkpoint")
#: nested sections whose other fields are read only while one of theirs is set: group -> (switch field, group title)
GROUP_SWITCHES = {"model.moe": ("model.moe.num_experts", "mixture of experts (optional; num_experts 0: a dense MLP)")}


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One form field: dotted name, the widget kind and (for choices) the options."""

    name: str  # "parallel.tensor_parallel"
    kind: str  # bool | choice | int | float | str | optional-int | optional-float | optional-str | datasets | json
    options: tuple = ()
    default: Any = None


def _kind(tp: Any) -> tuple[str, tuple]:
    origin = get_origin(tp)
    if origin is Literal:
        return "choice", get_args(tp)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in get_args(tp) if a is not type(None)]
        base, _ = _kind(inner[0])
        return f"optional-{base}", ()
    if origin is list and get_args(tp) and get_args(tp)[0] is DatasetEntry:
        return "datasets", ()
    # anything else (dicts, lists of plain values) is edited as JSON text
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(tp, "json"), ()


def _specs_of(cls: Any, prefix: str, default: Any) -> list[FieldSpec]:
    """The fields of dataclass ``cls`` named ``prefix.<field>``; a field that is itself a dataclass (a nested
    section such as ``model.moe``) contributes its own fields (``model.moe.top_k``) instead of one JSON box."""
    out = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, value = hints[f.name], getattr(default, f.name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += _specs_of(tp, f"{prefix}.{f.name}", value)
            continue
        kind, options = _kind(tp)
        out.append(FieldSpec(f"{prefix}.{f.name}", kind, options, value))
    return out


def field_specs() -> list[FieldSpec]:
    """Every editable field of RunConfig, in declaration order, from the dataclasses themselves."""
    out = [FieldSpec("name", "str", (), RunConfig().name)]
    hints = get_type_hints(RunConfig)
    default = RunConfig()
    for section in SECTIONS:
        out += _specs_of(hints[section], section, getattr(default, section))
    return out


def _group(name: str) -> str | None:
    """The nested section a field belongs to (``model.moe`` for ``model.moe.top_k``), None for a section's own field."""
    parts = name.split(".")
    return ".".join(parts[:-1]) if len(parts) > 2 else None


def _get(d: dict, name: str) -> Any:
    for part in name.split("."):
        d = d[part]
    return d


def _put(d: dict, name: str, value: Any) -> None:
    *head, last = name.split(".")
    for part in head:
        d = d.setdefault(part, {})
    d[last] = value


def _datasets_text(entries: list) -> str:
    rows = []
    for e in entries or []:
        e = e if isinstance(e, dict) else dataclasses.asdict(e)
        rows.append(f"{e['prefix']} {e.get('weight', 1.0):g}")
    return "\n".join(rows)


def _parse_datasets(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        weight: Any = 1.0
        if len(parts) > 1:
            try:
                weight = float(parts[-1])
            except ValueError:
                weight = parts[-1]  # from_dict reports it against the field
        out.append({"prefix": parts[0], "weight": weight})
    return out


class ConfigForm:
    """Widgets for a :class:`RunConfig` with live validation, planner readout, export and launch.

    Drive it programmatically (tests, scripts) with :meth:`set` / :meth:`load` / :meth:`export`
    / :meth:`launch`; read :attr:`config` and :attr:`problems`.
    """

    def __init__(self, cfg: RunConfig | None = None, *, preset_name: str | None = "tiny",
                 on_launch: Callable[[Any], None] | None = None, launch_kwargs: dict | None = None,
                 show_dashboard: bool = True):
        import ipywidgets as W

        self._W = W
        self.on_launch = on_launch
        self.launch_kwargs = dict(launch_kwargs or {})
        self.show_dashboard = show_dashboard
        self.specs = {s.name: s for s in field_specs()}
        self.fields: dict[str, Any] = {}
        self._parse_problems: list[Problem] = []
        self.messages: dict[str, Any] = {}
        self.rows: dict[str, Any] = {}
        self.groups: dict[str, Any] = {}  # nested section -> its collapsible box (an Accordion)
        self._suspend = False
        self.config: RunConfig = cfg or (preset(preset_name) if preset_name else RunConfig())
        self.problems: list[Problem] = []
        self.plan_text = ""
        self.prediction: Any = None  # the planner's last prediction object
        self.run = None

        self.preset = W.Dropdown(options=["(custom)", *PRESETS], value=preset_name if (preset_name and cfg is None) else "(custom)",
                                 description="preset")
        self.preset.observe(self._on_preset, names="value")
        rows: dict[str, list] = {s: [] for s in ("run", *SECTIONS)}
        grouped: dict[str, list] = {}
        # Every widget is a kernel-to-browser message when the form is shown (and each style or layout object one
        # more); the kernel's IOPub socket silently drops what a slow browser has not read past ZMQ's 1000-message
        # high-water mark.  So the fields share their style and layout objects and start at the config's values
        # (no update per field after): the form arrives as ~4 messages a field, well under that mark.
        self._shared: dict[Any, Any] = {}
        from workbench.widgets.layout import labelled

        # one description column for every field, fitting the longest name (make_vocab_size_divisible_by)
        self._shared["description_style"], self._shared[("layout", None)] = labelled(
            W, [s.split(".")[-1] for s in self.specs], 230)
        values = self.config.to_dict()
        msg_layout = W.Layout(width="auto")
        for spec in self.specs.values():
            w = self._make_widget(spec, self._to_widget(spec, _get(values, spec.name)))
            msg = self._share_style(W.HTML(layout=msg_layout, **self._style_of(W.HTML)))
            self.fields[spec.name], self.messages[spec.name] = w, msg
            w.observe(self._on_change, names="value")
            section = spec.name.split(".")[0] if "." in spec.name else "run"
            self.rows[spec.name] = W.HBox([w, msg])
            group = _group(spec.name)
            if group is None:
                rows[section].append(self.rows[spec.name])
                continue
            if group not in grouped:  # the group's box takes the place of the nested section's first field
                grouped[group] = []
                title = GROUP_SWITCHES.get(group, (None, group))[1]
                self.groups[group] = W.Accordion(children=[W.VBox(grouped[group])], titles=(title,), selected_index=None)
                rows[section].append(self.groups[group])
            grouped[group].append(self.rows[spec.name])
        for group, members in grouped.items():
            self.groups[group].children[0].children = members
        self.summary = W.HTML()
        self.plan = W.HTML()
        self.export_path = W.Text(value="run.yaml", description="export to", layout=W.Layout(width="360px"))
        self.export_button = W.Button(description="export", icon="download")
        self.export_button.on_click(lambda _b: self._export_clicked())
        self.launch_button = W.Button(description="launch", button_style="success", icon="play")
        self.launch_button.on_click(lambda _b: self._launch_clicked())
        self.output = W.Output()
        tabs = W.Tab(children=[W.VBox(rows[s]) for s in SECTIONS], titles=SECTIONS)
        self.widget = W.VBox([
            W.HBox([self.preset, *[r.children[0] for r in rows["run"]]]),
            tabs,
            self.summary,
            W.HTML("<b>memory plan</b>"), self.plan,
            W.HBox([self.export_path, self.export_button, self.launch_button]),
            self.output,
        ])
        self.load(self.config)

    # ---- widgets
    def _style_of(self, cls) -> dict:
        """``style=`` for a new widget of ``cls``: the one style object its kind shares, once it exists."""
        return {"style": self._shared[cls]} if cls in self._shared else {}

    def _share_style(self, w):
        """Keep the first widget of a kind's style object for the rest of that kind (:meth:`_style_of`)."""
        self._shared.setdefault(type(w), w.style)
        return w

    def _layout(self, height: str | None = None):
        """The fields' one layout object (per textarea height)."""
        if ("layout", height) not in self._shared:
            base = self._shared[("layout", None)]
            self._shared[("layout", height)] = self._W.Layout(width=base.width, flex=base.flex, height=height)
        return self._shared[("layout", height)]

    def _make_widget(self, spec: FieldSpec, value: Any):
        """The field's widget, showing ``value`` (shared style and layout objects: see the constructor)."""
        W = self._W
        label = spec.name.split(".")[-1]
        layout = self._layout({"datasets": "70px", "json": "160px"}.get(spec.kind))  # json: a nested section, wrapped
        if spec.kind == "bool":
            cls, kw = W.Checkbox, {"indent": True}
        elif spec.kind == "choice":
            cls, kw = W.Dropdown, {"options": list(spec.options)}
        elif spec.kind == "int":
            cls, kw = W.IntText, {}
        elif spec.kind == "float":
            cls, kw = W.FloatText, {}
        elif spec.kind in ("datasets", "json"):
            cls, kw = W.Textarea, {"placeholder": "one per line: PREFIX [WEIGHT]"} if spec.kind == "datasets" else {}
        else:
            cls, kw = W.Text, {"placeholder": "none" if spec.kind.startswith("optional") else ""}
        style = self._style_of(cls) or {"style": self._shared["description_style"]}
        return self._share_style(cls(description=label, value=value, layout=layout, **style, **kw))

    def _to_widget(self, spec: FieldSpec, value: Any) -> Any:
        if spec.kind == "datasets":
            return _datasets_text(value)
        if spec.kind == "json":
            return json.dumps(value, indent=1) if isinstance(value, dict) and value else json.dumps(value)
        if spec.kind.startswith("optional") or spec.kind == "str":
            return "" if value is None else str(value)
        return value

    def _from_widget(self, spec: FieldSpec, value: Any) -> Any:
        if spec.kind == "datasets":
            return _parse_datasets(value)
        if spec.kind == "json":
            try:
                return json.loads(value) if str(value).strip() else spec.default
            except ValueError as e:
                self._parse_problems.append(Problem(spec.name, f"not valid JSON ({e})", 'write JSON, e.g. {"alpha": 0.1}'))
                return spec.default
        if spec.kind.startswith("optional"):
            text = str(value).strip()
            if text == "" or text.lower() in ("none", "null"):
                return None
            for conv in ((int,) if spec.kind == "optional-int" else (float,) if spec.kind == "optional-float" else ()):
                try:
                    return conv(text)
                except ValueError:
                    return text  # RunConfig.from_dict names the field and the expected type
            return text
        return value

    # ---- state
    def values(self) -> dict[str, Any]:
        """The form as a nested dict (what RunConfig.from_dict receives)."""
        d: dict[str, Any] = {s: {} for s in SECTIONS}
        self._parse_problems = []
        for name, spec in self.specs.items():
            _put(d, name, self._from_widget(spec, self.fields[name].value))
        return d

    def load(self, cfg: RunConfig) -> None:
        """Show ``cfg`` in the form (one validation at the end, not one per field)."""
        d = cfg.to_dict()
        self._suspend = True
        try:
            for name, spec in self.specs.items():
                self.fields[name].value = self._to_widget(spec, _get(d, name))
        finally:
            self._suspend = False
        for group, box in self.groups.items():  # a group opens on a config that uses it, stays closed otherwise
            switch = GROUP_SWITCHES.get(group, (None,))[0]
            box.selected_index = 0 if switch is None or self.fields[switch].value else None
        self.revalidate()

    def set(self, name: str, value: Any) -> None:
        """Set one field by dotted name, as a user would (re-validates and re-plans).  A nested section's name
        (``model.moe``) takes a dict of its fields."""
        if name in self.groups and isinstance(value, dict):
            unknown = [k for k in value if f"{name}.{k}" not in self.fields]
            if unknown:
                raise KeyError(f"unknown field(s) of {name}: {', '.join(unknown)}")
            self._suspend = True
            try:
                for key, v in value.items():
                    self.fields[f"{name}.{key}"].value = self._to_widget(self.specs[f"{name}.{key}"], v)
            finally:
                self._suspend = False
            self._on_change(None)
            return
        if name not in self.fields:
            raise KeyError(f"unknown field {name!r}; known: {', '.join(self.fields)}")
        self.fields[name].value = self._to_widget(self.specs[name], value)

    def _on_change(self, _change) -> None:
        if not self._suspend:
            if self.preset.value != "(custom)":
                self._suspend = True
                self.preset.value = "(custom)"
                self._suspend = False
            self.revalidate()

    def _on_preset(self, change) -> None:
        if self._suspend or change["new"] == "(custom)":
            return
        self.load(preset(change["new"]))
        self._suspend = True
        self.preset.value = change["new"]
        self._suspend = False

    def revalidate(self) -> list[Problem]:
        """Rebuild the config from the widgets, validate, and refresh messages and plan."""
        values = self.values()
        try:
            cfg = RunConfig.from_dict(values)
            problems = self._parse_problems + cfg.validate()
            if not self._parse_problems:
                self.config = cfg
        except ConfigError as e:
            problems = self._parse_problems + list(e.problems)  # type errors: the previous config stays in .config
        self.problems = problems
        by_field: dict[str, list[Problem]] = {}
        unplaced = []
        for p in problems:
            key = self._field_for(p.field)
            (by_field.setdefault(key, []) if key else unplaced).append(p)
        for name, msg in self.messages.items():
            ps = by_field.get(name, [])
            msg.value = "".join(f"<span style='color:#d62728'>&#9888; {html.escape(p.rule)} &rarr; {html.escape(p.fix)}</span><br>"
                                for p in ps)
        if problems:
            items = "".join(f"<li><code>{html.escape(p.field)}</code>: {html.escape(p.rule)} &rarr; {html.escape(p.fix)}</li>" for p in problems)
            self.summary.value = f"<div style='color:#d62728'><b>{len(problems)} problem(s)</b><ul>{items}</ul></div>"
        else:
            self.summary.value = f"<div style='color:#2ca02c'><b>valid</b>: {html.escape(self._valid_line())}</div>"
        self.launch_button.disabled = bool(problems)
        self._show_applicable_fields(by_field)
        self._update_plan()
        return problems

    def _valid_line(self) -> str:
        d = self.config.derived()
        cp = int(getattr(self.config.parallel, "context_parallel", 1) or 1)
        return (f"world {d.world_size} = tp {self.config.parallel.tensor_parallel}{f' x cp {cp}' if cp > 1 else ''}"
                f" x pp {self.config.parallel.pipeline_parallel} x dp {d.data_parallel}; {d.params.total / 1e6:.2f}M parameters; "
                f"{plural(d.num_microbatches, 'micro-batch', 'micro-batches')} per step")

    def applies(self, name: str) -> bool:
        """Whether field ``name`` applies to the form's family and device, and (in a group with a switch) whether
        the group's switch is on (see the module docstring)."""
        arch = self.fields["model.arch"].value
        owners = [fam.name for fam in FAMILIES.values()
                  if name in fam.fields or any(name.startswith(f"{own}.") for own in fam.fields)]
        if owners and arch not in owners:
            return False
        switch = GROUP_SWITCHES.get(_group(name) or "", (None,))[0]
        if switch is not None and name != switch and not self.fields[switch].value:
            return False
        return not (name in GPU_ONLY_FIELDS and self.fields["parallel.device"].value != "cuda")

    def _show_applicable_fields(self, by_field: dict[str, list[Problem]]) -> None:
        """Show the fields that apply (and any field with a problem); the summary names the family."""
        for name, row in self.rows.items():
            row.layout.display = None if self.applies(name) or by_field.get(name) else "none"  # None: shown, as created
        for group, box in self.groups.items():  # a group with nothing to show is hidden whole
            members = [n for n in self.rows if _group(n) == group]
            shown = any(self.rows[n].layout.display != "none" for n in members)
            box.layout.display = None if shown else "none"
            if any(by_field.get(n) for n in members):
                box.selected_index = 0  # a problem inside: open it
        fam = FAMILIES.get(self.fields["model.arch"].value)
        if fam is not None and not self.problems:
            self.summary.value = self.summary.value.replace("<b>valid</b>:", f"<b>valid</b> ({html.escape(fam.title)}):", 1)

    def shown_fields(self) -> list[str]:
        """The dotted names of the fields the form shows now (a collapsed group's fields count: one click opens it)."""
        return [n for n, row in self.rows.items() if row.layout.display != "none"
                and (_group(n) not in self.groups or self.groups[_group(n)].layout.display != "none")]

    def _field_for(self, problem_field: str) -> str | None:
        name = problem_field.split("[")[0]
        if name in self.fields:
            return name
        if name in self.groups:  # a problem with the whole nested section: next to its switch (or first field)
            return GROUP_SWITCHES.get(name, (None,))[0] or next(n for n in self.fields if _group(n) == name)
        return None

    def _update_plan(self) -> None:
        if self.problems:
            self.plan_text = "(fix the problems above to see the memory plan)"
            self.plan.value = f"<i>{self.plan_text}</i>"
            return
        try:
            pred = planner.predict(self.config)
        except Exception as e:
            self.plan_text = f"planner error: {e}"
            self.plan.value = f"<span style='color:#d62728'>{html.escape(self.plan_text)}</span>"
            return
        self.prediction = pred
        table = plan_table(pred)
        self.plan_text, self.plan.value = table.text, table.html

    # ---- actions
    def export(self, path: str | Path) -> Path:
        """Write the config as JSON or YAML (by suffix). Refuses an invalid config."""
        self.revalidate()
        if self.problems:
            raise ConfigError(self.problems)
        return self.config.save(path)

    def _export_clicked(self) -> None:
        with self.output:
            try:
                print(f"wrote {self.export(self.export_path.value)}")
            except ConfigError as e:
                print(e)

    def launch(self, **kwargs: Any):
        """Launch the current config (``Run.launch``); shows the dashboard below the form."""
        self.revalidate()
        if self.problems:
            raise ConfigError(self.problems)
        self.run = Run.launch(self.config, **{**self.launch_kwargs, **kwargs})
        if self.on_launch is not None:
            self.on_launch(self.run)
        return self.run

    def _launch_clicked(self) -> None:
        with self.output:
            try:
                run = self.launch()
            except ConfigError as e:
                print(e)
                return
            print(f"launched: {run.run_dir}")
            if self.show_dashboard:
                from IPython.display import display

                from workbench.widgets.dashboard import Dashboard

                display(Dashboard(run))

    def report(self) -> str:
        """The validity summary and memory plan: text (print, papermill's text) that a notebook shows as HTML
        (the summary line, then the plan as a table: :func:`workbench.plots.tables.plan_table`)."""
        if self.problems:
            head = f"{len(self.problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in self.problems)
        else:
            head = f"valid: {self._valid_line()}"
        return Table(f"{head}\n\nmemory plan:\n{self.plan_text}",
                     f"{self.summary.value}<div><b>memory plan</b></div>{self.plan.value}")

    def to_json(self) -> str:
        return self.config.to_json()

    def to_yaml(self) -> str:
        return self.config.to_yaml()

    def _ipython_display_(self) -> None:
        from workbench.widgets.layout import show_live

        show_live(self.widget)

    def __repr__(self) -> str:
        return f"ConfigForm({self.config.name!r}, {len(self.problems)} problem(s))"

