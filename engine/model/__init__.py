"""The model math, as shared/spec/model.md reads: config, layers, indexer, attention, model, loader."""
