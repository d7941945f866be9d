"""bench/gpu_wheels.py: the GPU check's wheels are the tested versions, requirements followed for the GPU
machine's platform, and a requirement the tested file does not name stops the fetch."""

from __future__ import annotations

import zipfile

import pytest

from bench import gpu_wheels


def _wheel(folder, name, version, requires):
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            f"{name.replace('-', '_')}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n{meta}"
        )
    return path


def test_requirements_are_read_for_the_gpu_machines_platform(tmp_path):
    wheel = _wheel(
        tmp_path,
        "lib",
        "1.0",
        [
            "Huggingface_Hub<3,>=2",
            "colorama; sys_platform == 'win32'",
            "pytest; extra == 'test'",
            "tomli; python_version < '3.11'",
            "typing-extensions; python_version < '3.13'",
            "hf-xet; platform_machine == 'x86_64'",
        ],
    )
    assert gpu_wheels.wheel_requirements(wheel, "3.12") == ["huggingface-hub", "typing-extensions", "hf-xet"]
    assert gpu_wheels.wheel_requirements(wheel, "3.13") == ["huggingface-hub", "hf-xet"]


def _registry(monkeypatch, wheels):
    fetched = []

    def download(name, version, into, python):
        fetched.append(f"{name}=={version}")
        return _wheel(into, name, version, wheels[name])

    monkeypatch.setattr(gpu_wheels, "download", download)
    return fetched


def test_fetch_follows_requirements_at_the_tested_versions_and_leaves_the_image_alone(tmp_path, monkeypatch):
    tested = tmp_path / "tested.txt"
    tested.write_text("# frozen\nTransformers==5.25.0\nhuggingface_hub==2.4.0\nkernels==0.19.1\nnumpy==2.4.6\n")
    fetched = _registry(
        monkeypatch,
        {
            "transformers": ["huggingface-hub>=2", "numpy", "kernels<0.20"],
            "kernels": ["huggingface-hub", "torch"],
            "huggingface-hub": [],
        },
    )
    lines = gpu_wheels.fetch(tmp_path / "whl", "3.12", roots=("transformers",), tested=tested)
    assert lines == ["huggingface-hub==2.4.0", "kernels==0.19.1", "transformers==5.25.0"]
    assert sorted(fetched) == lines  # each once; torch and numpy stay the image's


def test_a_requirement_the_tested_file_does_not_name_stops_the_fetch(tmp_path, monkeypatch):
    tested = tmp_path / "tested.txt"
    tested.write_text("transformers==5.25.0\n")
    _registry(monkeypatch, {"transformers": ["brand-new-dep"]})
    with pytest.raises(SystemExit, match="brand-new-dep is needed .* names no version"):
        gpu_wheels.fetch(tmp_path / "whl", "3.12", roots=("transformers",), tested=tested)


def test_the_tested_file_names_every_root():
    pins = gpu_wheels.tested_versions()
    assert {gpu_wheels.canonical(r) for r in gpu_wheels.ROOTS} <= set(pins)
    assert pins["transformers"] and pins["flash-linear-attention"]
