"""Importers: other tools' profiles into pipeplan's profile format."""

from pipeplan.importers.pipedream import import_pipedream

__all__ = ["import_pipedream"]
