"""Environment variables: read in one module, bad values rejected by name."""

from __future__ import annotations

import pytest

from cudnn_graphs import ConfigError, config


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(config.CACHE_DIR, str(tmp_path / "c"))
    assert config.cache_dir() == tmp_path / "c"


def test_cache_dir_default_is_user_cache(monkeypatch):
    monkeypatch.delenv(config.CACHE_DIR, raising=False)
    assert config.cache_dir().name == "cudnn-graphs"


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_cache_dir_rejected(monkeypatch, value):
    monkeypatch.setenv(config.CACHE_DIR, value)
    with pytest.raises(ConfigError) as err:
        config.cache_dir()
    assert err.value.variable == config.CACHE_DIR


def test_cache_dir_that_is_a_file_rejected(monkeypatch, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.setenv(config.CACHE_DIR, str(f))
    with pytest.raises(ConfigError, match="not a directory"):
        config.cache_dir()


@pytest.mark.parametrize("value, expected", [(None, config.DEFAULT_MEMORY_CACHE_SIZE), ("0", 0), (" 64 ", 64)])
def test_memory_cache_size(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(config.MEMORY_CACHE_SIZE, raising=False)
    else:
        monkeypatch.setenv(config.MEMORY_CACHE_SIZE, value)
    assert config.memory_cache_size() == expected


@pytest.mark.parametrize("value", ["-1", "lots", "1.5"])
def test_bad_memory_cache_size(monkeypatch, value):
    monkeypatch.setenv(config.MEMORY_CACHE_SIZE, value)
    with pytest.raises(ConfigError) as err:
        config.memory_cache_size()
    assert err.value.value == value and config.MEMORY_CACHE_SIZE in str(err.value)


@pytest.mark.parametrize("value, expected", [("1", True), ("TRUE", True), ("off", False), ("", False)])
def test_disable_cache_flag(monkeypatch, value, expected):
    monkeypatch.setenv(config.DISABLE_CACHE, value)
    assert config.cache_disabled() is expected


def test_bad_flag(monkeypatch):
    monkeypatch.setenv(config.DISABLE_CACHE, "maybe")
    with pytest.raises(ConfigError):
        config.cache_disabled()


def test_only_config_module_reads_environment():
    """Triton's rule: every variable is read in config.py, so each has one place and one error."""
    import pathlib

    root = pathlib.Path(config.__file__).parent
    offenders = [p for p in root.rglob("*.py") if p.name != "config.py" and "os.environ" in p.read_text()]
    assert offenders == []
