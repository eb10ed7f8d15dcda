"""Your data: csv/parquet/npz tables as federations, scaling fitted on training rows only, errors naming the key."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from fedhog.config import ConfigError, RunConfig, load_config
from fedhog.data import (
    DataSpec,
    dataset_info,
    load_client_data,
    load_proxy_set,
    load_server_validation_set,
    load_test_set,
    population_training_data,
)


def _table(rows: int = 300, banks: int = 4, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "bank": rng.choice([f"b{i}" for i in range(banks)], rows),
        "amount": rng.lognormal(3, 1, rows),
        "category": rng.integers(0, 5, rows),
        "fraud": (rng.random(rows) < 0.1).astype(int),
    })


def _spec(path, **fields) -> DataSpec:
    return DataSpec(**{"dataset": f"csv:{path}", "label_column": "fraud", "client_column": "bank",
                       "population": 4, **fields})


@pytest.fixture
def csv_file(tmp_path):
    path = tmp_path / "t.csv"
    _table().to_csv(path, index=False)
    return path


def test_one_client_per_bank_holds_that_banks_rows_and_the_test_set_the_rest(csv_file):
    table = pd.read_csv(csv_file)
    spec = _spec(csv_file, validation_fraction=0.0)
    assert dataset_info(spec) == ((2,), 2)  # amount, category (bank and fraud are not features)
    test = load_test_set(spec)
    banks = sorted(table["bank"].unique())
    total = 0
    for client, bank in enumerate(banks):
        train, _ = load_client_data(spec, client)
        rows = int((table["bank"] == bank).sum())
        assert len(train) == rows - int(0.2 * rows)  # 20 % of each bank is held out for the test set
        total += len(train)
    assert total + len(test) == len(table)
    assert sorted(np.concatenate([load_client_data(spec, c)[0].y for c in range(4)]).tolist()
                  + test.y.tolist()) == sorted(table["fraud"].tolist())


@pytest.mark.parametrize("client_column", ["bank", ""])
def test_server_held_sets_take_their_share_apart_from_clients_and_test(csv_file, client_column):
    spec = _spec(csv_file, client_column=client_column, feature_columns="amount,category",
                 server_validation_fraction=0.1, proxy_fraction=0.05)
    held = [load_test_set(spec), load_server_validation_set(spec), load_proxy_set(spec)]
    clients = [part for c in range(4) for part in load_client_data(spec, c)]
    amounts = [set(np.round(s.x[:, 0], 6)) for s in [*held, *clients]]  # the scaled amount identifies a row
    assert sum(map(len, amounts)) == len(set().union(*amounts)) == len(pd.read_csv(csv_file))  # disjoint, covering
    assert len(held[1]) >= 0.1 * 300 - 4 and len(held[2]) >= 0.05 * 300 - 4  # each bank's share, rounded down


def test_scaling_is_fitted_on_the_training_rows_only(csv_file):
    spec = _spec(csv_file)
    x, _, indices = population_training_data(spec)
    train = x[np.concatenate(indices)].astype(np.float64)
    np.testing.assert_allclose(train.mean(axis=0), 0, atol=1e-5)  # exactly standard on the training rows ...
    np.testing.assert_allclose(train.std(axis=0), 1, atol=1e-5)
    validation = np.concatenate([load_client_data(spec, c)[1].x for c in range(4)])
    test = load_test_set(spec).x
    everything = np.concatenate([x, test]).astype(np.float64)
    assert len(validation) and len(test)
    assert abs(everything[:, 0].mean()) > 1e-3  # ... and not on all rows (the lognormal amount is skewed)
    # one affine map for every row (test rows too): sorted scaled values are a line of the sorted raw values
    raw = np.sort(pd.read_csv(csv_file)["amount"].to_numpy())
    scaled = np.sort(everything[:, 0])
    slope, intercept = np.polyfit(scaled, raw, 1)
    np.testing.assert_allclose(slope * scaled + intercept, raw, rtol=1e-5, atol=1e-4)


def test_without_a_client_column_a_partitioner_splits_the_pool(csv_file):
    spec = _spec(csv_file, client_column="", feature_columns="amount,category", population=6, partitioner="iid")
    sizes = [len(load_client_data(spec, c)[0]) + len(load_client_data(spec, c)[1]) for c in range(6)]
    assert sum(sizes) + len(load_test_set(spec)) == 300 and len(load_test_set(spec)) == 60


def test_parquet_and_npz_read_like_csv(tmp_path, csv_file):
    table = pd.read_csv(csv_file)
    table.to_parquet(tmp_path / "t.parquet", index=False)
    np.savez(tmp_path / "t.npz", **{name: np.asarray(table[name].tolist()) for name in table.columns})
    reference = load_test_set(_spec(csv_file))
    for name in ("parquet", "npz"):
        other = load_test_set(_spec(tmp_path / f"t.{name}", dataset=f"{name}:{tmp_path / f't.{name}'}"))
        np.testing.assert_array_equal(other.x, reference.x)
        np.testing.assert_array_equal(other.y, reference.y)


def test_an_npz_array_feature_keeps_its_example_shape(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "images.npz", x=rng.normal(size=(40, 1, 3, 3)), y=np.arange(40) % 3)
    spec = DataSpec(dataset=f"npz:{tmp_path / 'images.npz'}", label_column="y", population=2, partitioner="iid")
    assert dataset_info(spec) == ((1, 3, 3), 3)


def test_feature_columns_selects_and_orders_features(csv_file):
    spec = _spec(csv_file, feature_columns="category, amount")
    assert dataset_info(spec) == ((2,), 2)
    default = load_test_set(_spec(csv_file)).x
    np.testing.assert_array_equal(load_test_set(spec).x, default[:, ::-1])


def _config(path, **keys):
    return load_config({"dataset": f"csv:{path}", "label-column": "fraud", "client-column": "bank",
                        "population": 4, "sampling-rate": 0.5, "delta": 1e-3, **keys})


def _check_loaded(config: RunConfig) -> None:
    from fedhog.engines import check_inputs

    check_inputs(config)


@pytest.mark.parametrize("keys, expected", [
    ({"label-column": ""}, ["label-column=''", "the name of the label's column"]),
    ({"dataset": "xlsx:/a.xlsx"}, ["dataset='xlsx:/a.xlsx'", "'csv:PATH', 'parquet:PATH' or 'npz:PATH'"]),
])
def test_bad_tables_are_refused_when_the_config_is_read(csv_file, keys, expected):
    with pytest.raises(ConfigError) as error:
        _config(csv_file, **keys)
    assert all(part in str(error.value) for part in expected), str(error.value)


def test_the_column_keys_are_refused_for_built_in_datasets():
    with pytest.raises(ConfigError, match="label-column='y' is not allowed; expected '' for dataset='digits'"):
        load_config({"dataset": "digits", "label-column": "y"})


@pytest.mark.parametrize("keys, expected", [
    ({"dataset": "csv:/no/such/file.csv"}, ["dataset='csv:/no/such/file.csv'", "was not found"]),
    ({"label-column": "label"}, ["label-column='label'", "its columns are bank, amount, category, fraud"]),
    ({"feature-columns": "amount,colour"}, ["feature-columns='amount,colour'", "'colour' is not one"]),
    ({"client-column": "branch"}, ["client-column='branch'", "its columns are"]),
    ({"population": 6, "sampling-rate": 0.5}, ["population=6", "the 4 distinct values of client-column='bank'",
                                               "set population = 4"]),
    ({"feature-columns": "fraud,amount"}, ["feature-columns='fraud,amount'", "other than label-column='fraud'"]),
])
def test_bad_columns_are_refused_before_a_run_naming_the_key(csv_file, keys, expected):
    config = _config(csv_file, **keys)
    with pytest.raises(ConfigError) as error:
        _check_loaded(config)
    assert all(part in str(error.value) for part in expected), str(error.value)


def test_a_categorical_column_is_refused_with_what_to_do(tmp_path):
    table = _table()
    table["merchant"] = np.where(table["amount"] > 20, "grocery", "fuel")
    table.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(ConfigError) as error:
        _check_loaded(_config(tmp_path / "t.csv"))
    message = str(error.value)
    assert "feature-columns" in message and "'merchant'" in message and "encode them as numbers first" in message


def test_missing_feature_values_and_one_client_or_one_label_are_refused(tmp_path):
    table = _table()
    table.loc[3, "amount"] = np.nan
    table.to_csv(tmp_path / "nan.csv", index=False)
    with pytest.raises(ConfigError, match="'amount' has 1"):
        _check_loaded(_config(tmp_path / "nan.csv"))
    table = _table()
    table.loc[5, "fraud"] = np.nan
    table.to_csv(tmp_path / "label.csv", index=False)
    with pytest.raises(ConfigError, match="label-column='fraud' is not allowed; expected a column without missing "
                                          "values; it has 1"):
        _check_loaded(_config(tmp_path / "label.csv"))
    table = _table().assign(bank="only")
    table.to_csv(tmp_path / "one.csv", index=False)
    with pytest.raises(ConfigError, match=r"client-column='bank' is not allowed; expected a column with at least 2 "
                                          r"distinct values \(one client each\); it has one \('only'\)"):
        _check_loaded(_config(tmp_path / "one.csv"))
    table = _table().assign(fraud=0)
    table.to_csv(tmp_path / "label.csv", index=False)
    with pytest.raises(ConfigError, match="label-column='fraud' is not allowed; expected a column with at least 2"):
        _check_loaded(_config(tmp_path / "label.csv"))


def test_a_relative_table_path_is_made_absolute_for_every_process(csv_file, monkeypatch):
    monkeypatch.chdir(csv_file.parent)
    config = _config("t.csv")
    assert config.dataset == f"csv:{csv_file}"


def test_auroc_and_auprc_are_refused_for_more_than_two_classes():
    config = load_config({"dataset": "digits", "metrics": "accuracy,auprc", "population": 10})
    with pytest.raises(ConfigError, match="metrics='accuracy,auprc' is not allowed for dataset='digits': auprc need "
                                          "a binary label and it has 10 classes"):
        _check_loaded(config)
    with pytest.raises(ConfigError, match="metrics='accuracy,f1' is not allowed; expected comma-separated names "
                                          "among accuracy, auroc, auprc"):
        load_config({"metrics": "accuracy,f1"})


def test_fedhog_run_refuses_a_bad_table_before_it_claims_a_results_folder(csv_file, monkeypatch, capsys):
    from fedhog.cli import main

    monkeypatch.chdir(csv_file.parent)
    (csv_file.parent / "bad.toml").write_text(f'dataset = "csv:{csv_file}"\nlabel-column = "is_fraud"\n'
                                              'client-column = "bank"\npopulation = 4\nsampling-rate = 0.5\n'
                                              'delta = 1e-3\n')
    assert main(["run", "bad.toml", "--engine", "inprocess"]) == 2
    assert "config error: data: label-column='is_fraud' is not allowed" in " ".join(capsys.readouterr().err.split())
    assert not (csv_file.parent / "results").exists()
