"""From a model spec to the files the engine loads: where they come from
(model_files.py), what the load will do with them (load_plan.py), the checks that
refuse damaged files before any weight is read (hf_check.py, gguf_check.py) and the
cache folder (cache_folder.py)."""
