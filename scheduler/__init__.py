"""ggufq placement side: settings, model registry, memory estimate, decision, Redis state."""
