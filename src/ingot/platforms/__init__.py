"""Platform plugins, following vLLM's convention.

A platform plugin is a function that takes no arguments and returns the fully qualified name of a
``Platform`` subclass if that platform can be used on this machine, else ``None``. Plugins are
registered under the ``ingot.platforms`` entry-point group; the built-in ``cpu`` and ``cuda``
plugins are also registered here in code, so discovery works from a source checkout that was
never pip-installed.

Plugin functions must stay cheap and must not import heavy modules or initialise a device: every
``resolve_platform("auto")`` call runs all of them.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from ingot.platforms.interface import Platform

logger = logging.getLogger("ingot")

ENTRY_POINT_GROUP = "ingot.platforms"

PlatformPlugin = Callable[[], "str | None"]


def cpu_platform_plugin() -> str | None:
    # The CPU is always usable; it is the last resort of "auto".
    return "ingot.platforms.cpu.CpuPlatform"


def cuda_platform_plugin() -> str | None:
    import torch

    return "ingot.platforms.cuda.CudaPlatform" if torch.cuda.is_available() else None


BUILTIN_PLATFORM_PLUGINS: dict[str, PlatformPlugin] = {
    "cpu": cpu_platform_plugin,
    "cuda": cuda_platform_plugin,
}


def _target(ep: EntryPoint) -> str:
    return ep.value.replace(" ", "")


def _builtin_target(fn: PlatformPlugin) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


def discover_platform_plugins() -> dict[str, PlatformPlugin]:
    """Built-in plugins plus those registered under the ``ingot.platforms`` entry-point group.

    Built-in names cannot be taken over, and a name claimed by two distributions keeps the
    first one seen; both cases log a warning rather than silently picking a winner. A plugin whose
    entry point fails to load is logged and skipped.
    """
    plugins: dict[str, PlatformPlugin] = dict(BUILTIN_PLATFORM_PLUGINS)
    sources: dict[str, str] = {name: _builtin_target(fn) for name, fn in plugins.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        target = _target(ep)
        if sources.get(ep.name) == target:
            continue  # ingot's own entry points when installed, or a duplicate dist-info
        if ep.name in BUILTIN_PLATFORM_PLUGINS:
            logger.warning(
                "ignoring platform plugin %r -> %s: %r is a built-in platform name",
                ep.name,
                target,
                ep.name,
            )
            continue
        if ep.name in sources:
            logger.warning(
                "ignoring platform plugin %r -> %s: the name is already registered by %s",
                ep.name,
                target,
                sources[ep.name],
            )
            continue
        try:
            fn = ep.load()
        except Exception as e:
            logger.warning("failed to load platform plugin %r -> %s: %r", ep.name, target, e)
            continue
        if not callable(fn):
            logger.warning("ignoring platform plugin %r -> %s: not callable", ep.name, target)
            continue
        plugins[ep.name] = fn
        sources[ep.name] = target
    return plugins


def _activate(name: str, plugin: PlatformPlugin) -> str | None:
    """Run a plugin; one that raises is treated as unavailable, so it cannot break "auto"."""
    try:
        qualname = plugin()
    except Exception as e:
        logger.warning(
            "platform plugin %r raised on activation, treating it as unavailable: %r", name, e
        )
        return None
    if qualname is not None and not isinstance(qualname, str):
        logger.warning(
            "platform plugin %r returned %r, not a class name; treating it as unavailable",
            name,
            qualname,
        )
        return None
    return qualname or None


def _load_platform_class(name: str, qualname: str) -> type[Platform]:
    module_name, _, class_name = qualname.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ImportError(
            f"platform plugin {name!r} named {qualname!r}, which cannot be imported: {e}"
        ) from e
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise TypeError(
            f"platform plugin {name!r} named {qualname!r}, which is not a subclass "
            f"of ingot.platforms.interface.Platform"
        )
    return cls


def resolve_platform(device: str = "auto") -> type[Platform]:
    """Pick the platform class for ``--device``.

    ``"auto"``: the one out-of-tree plugin that activates if there is exactly one (installing a
    plugin is how a user asks for it; with several we refuse to guess), else ``cuda`` if usable,
    else ``cpu``. Any other value names a plugin, which must activate on this machine.
    """
    plugins = discover_platform_plugins()
    if device == "auto":
        activated = {
            name: qualname
            for name, plugin in plugins.items()
            if name not in BUILTIN_PLATFORM_PLUGINS
            and (qualname := _activate(name, plugin)) is not None
        }
        if len(activated) > 1:
            names = ", ".join(sorted(activated))
            raise ValueError(
                f"several platform plugins are available ({names}); "
                f"pass --device NAME to choose one"
            )
        if activated:
            ((name, qualname),) = activated.items()
            return _load_platform_class(name, qualname)
        for name in ("cuda", "cpu"):
            qualname = _activate(name, plugins[name])
            if qualname is not None:
                return _load_platform_class(name, qualname)
        raise RuntimeError("no platform is available, not even cpu")

    if device not in plugins:
        raise ValueError(f"unknown device {device!r}; available: {', '.join(sorted(plugins))}")
    qualname = _activate(device, plugins[device])
    if qualname is None:
        raise ValueError(f"device {device!r} is not available on this machine")
    return _load_platform_class(device, qualname)


__all__ = [
    "BUILTIN_PLATFORM_PLUGINS",
    "ENTRY_POINT_GROUP",
    "Platform",
    "cpu_platform_plugin",
    "cuda_platform_plugin",
    "discover_platform_plugins",
    "resolve_platform",
]
