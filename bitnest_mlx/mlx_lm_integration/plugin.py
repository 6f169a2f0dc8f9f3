"""mlx-lm plugin: model types `bitnest` and `deepseek_v4`, and self-speculation via --draft-model.

mlx-lm resolves `config["model_type"]` to the module `mlx_lm.models.<type>`. The startup hook
(bitnest_mlx_hook.pth -> bitnest_mlx_hook.BitnestFinder) calls `find_spec` here when mlx-lm
imports one of these modules, so any process sees bitnest models without importing us:

* `mlx_lm.models.bitnest` / `mlx_lm.models.deepseek_v4`: made from our model classes.
* `mlx_lm.utils` (patched right after it runs): `load_model` builds our formats with
  `bitnest_mlx.runtime.loader` (the same validated model `bitnest_mlx.load` gives);
  `load_tokenizer` keeps transformers off the package's config.json; `load`
  understands `PATH#draft`: the draft reading (W4/KV4) of the bitnest target loaded from PATH,
  over the same arrays.
* `mlx_lm.generate` (patched right after it runs): `speculative_generate_step` runs bitnest's
  shared-cache loop for a (target, PATH#draft) pair and mlx-lm's own loop otherwise.
  `stream_generate` looks the function up at call time, so mlx-lm's CLI and server both use it.
  `main` (`python -m mlx_lm generate`) turns our format errors into one line `error: ...`, exit 2.
* `mlx_lm.chat`, `mlx_lm.server` (patched right after they run): the same for their `main`; the
  server loads a model of our formats before it listens (`patch_server`). `bitnest-server` does
  not go through `mlx_lm.server.main` at all: it composes mlx-lm's server classes itself.

A broken package or bundle raises our own error from `mlx_lm.load` (PackageError / BundleError:
one line naming file, tensor, expectation), never an error from deep inside mlx-lm or
transformers.

`register()` (exported as `bitnest_mlx.register_mlx_lm`) does the same in a process started
without the hook, patching mlx-lm modules that are already imported.

This module is the only place that changes mlx-lm at run time (bitnest-server composes mlx-lm's
server classes instead: serving.py). Each patch says why mlx-lm offers no seam for it, and
tests/test_mlx_lm_seams.py fails when an mlx-lm upgrade moves what a patch relies on.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import weakref
from collections.abc import Callable
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from types import ModuleType

from ..formats import detect
from ..formats.safetensors_io import read_json
from .speculation import (  # noqa: F401  (DraftView, as_bitnest_sampler: public here)
    DRAFT_SUFFIX,
    DraftView,
    as_bitnest_sampler,
    shared_cache_steps,
    supports_draft,
)

# Nothing here may import mlx_lm at module level: the startup hook imports this module while
# mlx-lm is being imported. Model code is imported when first needed.


@functools.cache
def _bitnest_classes() -> tuple[type, type]:
    """(Model, ModelArgs) of `mlx_lm.models.bitnest`: the bitnest model in `default_dtype()`."""
    from ..models import bitnest_llama
    from ..runtime.loader import default_dtype

    _register_cache()

    class Model(bitnest_llama.Model):
        def __init__(self, args: bitnest_llama.ModelArgs):
            super().__init__(args)
            self.set_dtype(default_dtype())

    return Model, bitnest_llama.ModelArgs


@functools.cache
def _register_cache() -> None:
    """load_prompt_cache looks cache classes up by name in mlx_lm.models.cache."""
    # No seam: `load_prompt_cache` resolves each saved class name through that module's
    # `globals()`, with no registry to add a class to, so ours must be a name there.
    import mlx_lm.models.cache

    from ..layers.nested_kv import NestedKVCache

    mlx_lm.models.cache.NestedKVCache = NestedKVCache


def split_draft(path_or_repo: str) -> tuple[str, bool]:
    """ "PATH#draft" -> (PATH, True); anything else -> (it, False)."""
    text = str(path_or_repo)
    if text.endswith(DRAFT_SUFFIX):
        return text[: -len(DRAFT_SUFFIX)], True
    return text, False


# ---------------------------------------------------------------------------------------------
# Import hooks


class _PatchAfterExec(Loader):
    """Runs the real loader, then `patch(module)`; everything else is the real loader's."""

    def __init__(self, loader: Loader, patch):
        self.loader, self.patch = loader, patch

    def __getattr__(self, name: str):
        return getattr(self.loader, name)

    def create_module(self, spec: ModuleSpec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class _ModelModule(Loader):
    """`mlx_lm.models.bitnest` / `mlx_lm.models.deepseek_v4`: our Model and ModelArgs."""

    def create_module(self, spec: ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        if module.__name__.endswith(".bitnest"):
            module.Model, module.ModelArgs = _bitnest_classes()
        else:
            from ..models import deepseek_v4

            module.Model, module.ModelArgs = deepseek_v4.Model, deepseek_v4.ModelArgs


def find_spec(fullname: str, path=None, target=None) -> ModuleSpec | None:
    """The spec for one of `WATCHED` (see the module docstring)."""
    if fullname.startswith("mlx_lm.models."):
        return importlib.util.spec_from_loader(fullname, _ModelModule())
    spec = PathFinder.find_spec(fullname, path, target)
    if spec is not None and spec.loader is not None:
        spec.loader = _PatchAfterExec(spec.loader, PATCHES[fullname])
    return spec


class BitnestFinder(MetaPathFinder):
    """The startup hook's finder (bitnest_mlx_hook.BitnestFinder: the same name, so either is
    installed once) for a process started without it: the hook hands over to this module, so
    this module does not import the hook."""

    def find_spec(self, fullname, path=None, target=None):
        return find_spec(fullname, path, target) if fullname in WATCHED else None


def register() -> None:
    """Make mlx-lm see bitnest models in this process (what the .pth hook does at startup)."""
    if not any(type(f).__name__ == "BitnestFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, BitnestFinder())
    utils = sys.modules.get("mlx_lm.utils")
    if utils is not None and not _patched(utils.load):
        original = utils.load
        patch_utils(utils)
        # Modules that did `from .utils import load` hold the original.
        for mod in list(sys.modules.values()):
            name = getattr(mod, "__name__", "")
            if name.startswith("mlx_lm") and getattr(mod, "load", None) is original:
                mod.load = utils.load
    for name in ("mlx_lm.generate", "mlx_lm.chat", "mlx_lm.server"):
        if name in sys.modules:
            PATCHES[name](sys.modules[name])


# ---------------------------------------------------------------------------------------------
# mlx_lm.utils


def _patched(fn) -> bool:
    return getattr(fn, "_bitnest", False)


def _mark(fn):
    fn._bitnest = True
    return fn


def _local_format(path) -> str | None:
    """Our format of a local directory; "bitnest" also when only config.json says so (the
    manifest is missing), so that the bitnest reader names what is wrong."""
    path = Path(path)
    if not path.is_dir():
        return None
    found = detect(path)
    if found is None:
        try:
            config = read_json(path / "config.json", ValueError)
        except ValueError:  # not ours to judge: mlx-lm's own loader names the problem
            return None
        if config.get("model_type") == "bitnest":
            return "bitnest"
    return found


def _format_error(fmt: str) -> type[Exception]:
    from ..formats.bitnest import PackageError
    from ..formats.dsv4_bundle import BundleError

    return BundleError if fmt == "dsv4" else PackageError


# Targets loaded through mlx-lm: key -> (weakref to model, tokenizer, config). Lets `PATH#draft`
# reuse the target's arrays instead of loading the package a second time.
_TARGETS: dict[str, tuple] = {}


def _key(path_or_repo: str) -> str:
    path = Path(path_or_repo).expanduser()
    return str(path.resolve()) if path.exists() else str(path_or_repo)


def patch_utils(utils: ModuleType) -> None:
    # No seam: mlx-lm builds every model through `utils.load` / `load_model` /
    # `load_tokenizer`, looked up as module globals by its CLIs and server, with no hook for a
    # format whose files are not safetensors-by-config (our validated readers), nor for a
    # model name (`PATH#draft`) that is a view of another model.
    if _patched(utils.load):
        return
    # Each wraps the function it replaces.
    utils.load_model = _load_model(utils, utils.load_model)
    utils.load_tokenizer = _load_tokenizer(utils.load_tokenizer)
    utils.load = _load(utils.load)


def _load_model(utils: ModuleType, orig_load_model: Callable) -> Callable:
    """`utils.load_model` that reads bitnest packages and bundles with our validated loader."""

    @_mark
    @functools.wraps(orig_load_model)
    def load_model(model_path, lazy=False, strict=True, model_config=None, *args, **kwargs):
        fmt = _local_format(model_path)
        if fmt is None:
            return orig_load_model(model_path, lazy, strict, model_config, *args, **kwargs)
        from ..runtime.loader import load_model as load_ours

        if not (Path(model_path) / "config.json").is_file():
            raise _format_error(fmt)(
                f"{Path(model_path) / 'config.json'}: missing; mlx-lm reads the model's "
                "config.json (bitnest-convert writes it next to the manifest)"
            )
        _register_cache()
        model = load_ours(model_path)  # validated, weights evaluated (lazy does not apply)
        config = utils.load_config(Path(model_path))
        config.update(model_config or {})
        return model, config

    return load_model


def _load_tokenizer(orig_load_tokenizer: Callable) -> Callable:
    """`utils.load_tokenizer` that checks our formats' tokenizer files, without their config."""

    @_mark
    @functools.wraps(orig_load_tokenizer)
    def load_tokenizer(model_path, tokenizer_config_extra=None, *args, **kwargs):
        fmt = _local_format(model_path)
        if fmt is not None:
            # transformers cannot parse these config.json files (unknown model_type, llama3
            # rope scaling); an empty config stops AutoTokenizer from reading it.
            from ..runtime.loader import (
                TOKENIZER_DEFINING,
                checked_tokenizer,
                has_tokenizer,
                tokenizer_config,
            )

            if not has_tokenizer(model_path):
                raise _format_error(fmt)(
                    f"{model_path}: no tokenizer files (expected one of "
                    f"{', '.join(TOKENIZER_DEFINING)}); mlx-lm needs a tokenizer"
                )

            tokenizer_config_extra = {
                "config": tokenizer_config(),
                **(tokenizer_config_extra or {}),
            }
            return checked_tokenizer(
                model_path,
                _format_error(fmt),
                orig_load_tokenizer,
                tokenizer_config_extra,
                *args,
                **kwargs,
            )
        return orig_load_tokenizer(model_path, tokenizer_config_extra, *args, **kwargs)

    return load_tokenizer


def _load(orig_load: Callable) -> Callable:
    """`utils.load` that also loads `PATH#draft`: the draft view of PATH's live target."""

    @_mark
    @functools.wraps(orig_load)
    def load(path_or_hf_repo, *args, return_config: bool = False, **kwargs):
        base, draft = split_draft(path_or_hf_repo)
        if not draft:
            model, tokenizer, config = orig_load(
                path_or_hf_repo, *args, return_config=True, **kwargs
            )
            if supports_draft(model):
                _TARGETS[_key(base)] = (weakref.ref(model), tokenizer, config)
            return (model, tokenizer, config) if return_config else (model, tokenizer)
        ref, tokenizer, config = _TARGETS.get(_key(base), (lambda: None, None, None))
        target = ref()
        if target is None:  # no live target for PATH: load it once, here
            target, tokenizer, config = load(base, *args, return_config=True, **kwargs)
        if not supports_draft(target):
            raise ValueError(f"{path_or_hf_repo}: {DRAFT_SUFFIX} needs a bitnest package")
        view = DraftView(target)
        return (view, tokenizer, config) if return_config else (view, tokenizer)

    return load


# ---------------------------------------------------------------------------------------------
# mlx_lm.generate


def patch_generate(generate: ModuleType) -> None:
    # No seam: `stream_generate` calls the module global `speculative_generate_step` whenever a
    # draft model is given, with no argument choosing the loop, and our draft shares the
    # target's cache (a loop mlx-lm's cannot run). `main` catches nothing of ours.
    orig = generate.speculative_generate_step
    if not _patched(orig):

        @_mark
        @functools.wraps(orig)
        def speculative_generate_step(prompt, model, draft_model, *args, **kwargs):
            if isinstance(draft_model, DraftView):
                return shared_cache_steps(prompt, model, draft_model, **kwargs)
            return orig(prompt, model, draft_model, *args, **kwargs)

        generate.speculative_generate_step = speculative_generate_step
    if not _patched(generate.main):
        generate.main = one_line_errors(generate.main)


def patch_chat(chat: ModuleType) -> None:
    """`mlx_lm chat` loads in its main: our load errors become one line."""
    # No seam: `main` parses, loads and loops in one function; a wrapper is the only way to
    # turn our load errors into one line.
    if not _patched(chat.main):
        chat.main = one_line_errors(chat.main)


def patch_server(server: ModuleType) -> None:
    """`mlx_lm server` loads its default model in the generation thread, after the port is
    open, so a broken package would leave a listening server that fails every request. For our
    formats the default model is loaded in `ModelProvider.__init__`, before the server starts
    (the thread's load is then a no-op: same model key), and `main` reports a load error as one
    line, exit 2. Other models keep mlx-lm's own timing."""
    # No seam: `mlx_lm.server.main` builds its parser and a plain `ModelProvider` inside one
    # function (bitnest-server, which has its own `main`, subclasses the provider instead).
    provider = server.ModelProvider
    if not _patched(provider.__init__):
        orig_init = provider.__init__

        @_mark
        @functools.wraps(orig_init)
        def __init__(self, cli_args, *args, **kwargs):
            orig_init(self, cli_args, *args, **kwargs)
            model = getattr(cli_args, "model", None)
            # Subclasses (bitnest-server's provider) load on their own terms.
            stock = type(self) is provider
            if stock and model is not None and _local_format(split_draft(model)[0]) is not None:
                self.load_default()

        provider.__init__ = __init__
    if not _patched(server.main):
        server.main = one_line_errors(server.main)


def one_line_errors(main):
    """An mlx-lm CLI `main` that reports our load errors (a broken package or bundle, a Hub id
    that cannot be resolved) as one line `error: ...` on stderr and exits with status 2, as our
    own commands do. Any other error is mlx-lm's to report."""

    @_mark
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        from ..cli.args import refuse
        from ..runtime.loader import LOAD_ERRORS

        try:
            return main(*args, **kwargs)
        except LOAD_ERRORS as e:
            raise SystemExit(refuse(e)) from None

    return wrapper


PATCHES = {  # module name -> what runs right after mlx-lm's module itself
    "mlx_lm.utils": patch_utils,
    "mlx_lm.generate": patch_generate,
    "mlx_lm.chat": patch_chat,
    "mlx_lm.server": patch_server,
}
# What the finders act on (bitnest_mlx_hook.WATCHED is the same set: the hook imports nothing).
WATCHED = frozenset((*PATCHES, "mlx_lm.models.bitnest", "mlx_lm.models.deepseek_v4"))
