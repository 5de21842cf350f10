from __future__ import annotations

from pathlib import Path

import pytest
from conftest import write_image

from fedhisto.config.study import SourceSpec
from fedhisto.realdata.sources import (
    SourceError,
    collect_sources,
    read_lc25000,
    read_lunghist700,
    read_sources_csv,
    read_wsss4luad,
    write_sources_csv,
    wsss4luad_label,
)


def lc25000_fixture(root: Path, per_class: int = 2) -> Path:
    for i, folder in enumerate(("lung_aca", "lung_n", "lung_scc")):
        for k in range(per_class):
            write_image(root / folder / f"{folder.replace('_', '')}{k + 1}.jpeg", seed=10 * i + k, fmt="JPEG")
    return root


def test_lc25000_reads_three_class_folders(tmp_path: Path):
    root = lc25000_fixture(tmp_path / "lung_image_sets")
    rows, excluded = read_lc25000(SourceSpec(kind="lc25000", root=str(root)))
    assert excluded == []
    assert [r.label for r in rows] == ["ACA", "ACA", "Normal", "Normal", "SCC", "SCC"]
    assert rows[0].relpath == "lc25000/lung_aca/lungaca1.jpeg"
    assert {r.source for r in rows} == {"lc25000"} and {r.cohort for r in rows} == {"internal"}
    assert Path(rows[0].path).is_absolute()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: __import__("shutil").rmtree(r / "lung_scc"), "class SCC: folder not found"),
        (lambda r: (r / "colon_aca").mkdir(), "unknown class folder(s) ['colon_aca']"),
        (lambda r: (r / "lung_n" / "lungn9.jpeg").write_bytes(b""), "unreadable image"),
    ],
)
def test_lc25000_errors_name_the_problem(tmp_path: Path, mutate, message):
    root = lc25000_fixture(tmp_path / "lc")
    mutate(root)
    with pytest.raises(SourceError) as err:
        read_lc25000(SourceSpec(kind="lc25000", root=str(root)))
    assert message in str(err.value)


def test_missing_root_is_named(tmp_path: Path):
    with pytest.raises(SourceError, match=r"folder not found: .*nowhere"):
        read_lc25000(SourceSpec(kind="lc25000", root=str(tmp_path / "nowhere")))


def test_hidden_and_non_image_files_are_not_images_and_are_listed(tmp_path: Path):
    root = lc25000_fixture(tmp_path / "lc")
    (root / "lung_n" / ".DS_Store").write_bytes(b"\0")
    (root / "lung_n" / "notes.txt").write_text("x")
    rows, excluded = read_lc25000(SourceSpec(kind="lc25000", root=str(root)))
    assert len(rows) == 6
    assert [(Path(e.path).name, e.reason.split(" (")[0]) for e in excluded] == [
        (".DS_Store", "hidden file or folder"), ("notes.txt", "not an image file")]


@pytest.mark.parametrize(
    ("vector", "label"),
    [((1, 0, 0), "ACA"), ((1, 1, 0), "ACA"), ((0, 0, 1), "Normal"), ((0, 1, 1), "Normal"),
     ((1, 0, 1), None), ((1, 1, 1), None), ((0, 1, 0), None), ((0, 0, 0), None)],
)
def test_wsss4luad_label_mapping(vector, label):
    assert wsss4luad_label(*vector) == label


def test_wsss4luad_reads_names_and_records_exclusions(tmp_path: Path):
    root = tmp_path / "1.training"
    write_image(root / "436219-7159-48057-[1, 0, 0].png", 1)
    write_image(root / "436219-7159-48058-[0, 0, 1].png", 2)
    write_image(root / "436219-7159-48059-[0, 1, 0].png", 3)
    rows, excluded = read_wsss4luad(SourceSpec(kind="wsss4luad", root=str(root)))
    assert [r.label for r in rows] == ["ACA", "Normal"]
    assert len(excluded) == 1 and "[0, 1, 0]" in excluded[0].reason and excluded[0].path.endswith("48059-[0, 1, 0].png")
    with pytest.raises(SourceError, match=r"48059-\[0, 1, 0\]\.png: label vector \[0, 1, 0\]"):
        read_wsss4luad(SourceSpec(kind="wsss4luad", root=str(root), unmapped="error"))


def test_wsss4luad_unlabelled_name_is_an_error(tmp_path: Path):
    write_image(tmp_path / "w" / "tile_001.png")
    with pytest.raises(SourceError, match=r"carries no .tumor, stroma, normal. label: .*tile_001\.png"):
        read_wsss4luad(SourceSpec(kind="wsss4luad", root=str(tmp_path / "w")))


def test_lunghist700_parses_metadata(tmp_path: Path):
    root = tmp_path / "lh"
    for name in ("aca_bd_20x_1.jpg", "scc_pd_40x_7.jpg", "nor_20x_3.jpg", "aca_md_40x_2.JPG"):
        write_image(root / name, fmt="JPEG")
    rows, _ = read_lunghist700(SourceSpec(kind="lunghist700", root=str(root), cohort="external"))
    got = {Path(r.path).name: (r.label, r.differentiation, r.magnification, r.cohort) for r in rows}
    assert got == {
        "aca_bd_20x_1.jpg": ("ACA", "well", "20x", "external"),
        "aca_md_40x_2.JPG": ("ACA", "moderately", "40x", "external"),
        "nor_20x_3.jpg": ("Normal", "", "20x", "external"),
        "scc_pd_40x_7.jpg": ("SCC", "poorly", "40x", "external"),
    }


@pytest.mark.parametrize("name", ["lus_bd_20x_1.jpg", "aca_20x_1.jpg", "aca_xd_20x_1.jpg", "aca_bd_10x_1.jpg"])
def test_lunghist700_bad_names(tmp_path: Path, name: str):
    write_image(tmp_path / "lh" / name, fmt="JPEG")
    with pytest.raises(SourceError, match=name.replace(".", r"\.")):
        read_lunghist700(SourceSpec(kind="lunghist700", root=str(tmp_path / "lh")))


def test_csv_source_and_label_aliases(tmp_path: Path):
    write_image(tmp_path / "img" / "a.png")
    write_image(tmp_path / "img" / "b.png", 1)
    csv_path = tmp_path / "list.csv"
    csv_path.write_text("path,label,magnification\nimg/a.png,adenocarcinoma,20x\nimg/b.png,Normal,\n")
    rows, _ = collect_sources([SourceSpec(kind="csv", root=str(csv_path), site="mysite")])
    assert [(r.label, r.relpath, r.magnification) for r in rows] == [
        ("ACA", "mysite/img/a.png", "20x"), ("Normal", "mysite/img/b.png", "")]
    csv_path.write_text("path,label\nimg/a.png,tumour\n")
    with pytest.raises(SourceError, match=r"list.csv:2: unknown label 'tumour'"):
        collect_sources([SourceSpec(kind="csv", root=str(csv_path))])
    csv_path.write_text("path,label\nimg/zz.png,ACA\n")
    with pytest.raises(SourceError, match=r"list.csv:2: image not found: .*zz.png"):
        collect_sources([SourceSpec(kind="csv", root=str(csv_path))])


def test_csv_rows_outside_the_csv_folder_need_a_relpath_root(tmp_path: Path):
    data = tmp_path / "elsewhere" / "lc"
    write_image(data / "lung_aca" / "a.jpeg", fmt="JPEG")
    write_image(data / "lung_n" / "b.jpeg", 1, fmt="JPEG")
    lists = tmp_path / "lists"
    lists.mkdir()
    csv_path = lists / "list.csv"
    csv_path.write_text(f"path,label\n{data / 'lung_aca/a.jpeg'},ACA\n{data / 'lung_n/b.jpeg'},Normal\n")
    with pytest.raises(SourceError) as err:  # never a pathlib traceback: the row and a way out are named
        collect_sources([SourceSpec(kind="csv", root=str(csv_path), site="extra")])
    msg = str(err.value)
    assert f"{csv_path}:2: image {data / 'lung_aca/a.jpeg'} lies outside {lists}" in msg
    assert "2 row(s) do" in msg and f"A relpath_root holding every row: {data}" in msg
    rows, _ = collect_sources([SourceSpec(kind="csv", root=str(csv_path), site="extra", relpath_root=str(data))])
    assert [(r.relpath, r.label) for r in rows] == [("extra/lung_aca/a.jpeg", "ACA"), ("extra/lung_n/b.jpeg", "Normal")]
    assert rows[0].path == str((data / "lung_aca/a.jpeg").resolve())
    csv_path.write_text("path,label\n../elsewhere/lc/lung_aca/a.jpeg,ACA\n")  # relative, but outside too
    with pytest.raises(SourceError, match=r"list.csv:2: image .*a.jpeg lies outside"):
        collect_sources([SourceSpec(kind="csv", root=str(csv_path))])
    with pytest.raises(SourceError, match=r"relpath_root is not a folder: .*nowhere"):
        collect_sources([SourceSpec(kind="csv", root=str(csv_path), relpath_root=str(tmp_path / "nowhere"))])


def test_csv_row_symlinked_elsewhere_keeps_its_listed_relpath(tmp_path: Path):
    target = write_image(tmp_path / "store" / "x.png")
    (tmp_path / "list" / "img").mkdir(parents=True)
    (tmp_path / "list" / "img" / "a.png").symlink_to(target)
    (tmp_path / "list" / "l.csv").write_text("path,label\nimg/a.png,SCC\n")
    rows, _ = collect_sources([SourceSpec(kind="csv", root=str(tmp_path / "list" / "l.csv"), site="s")])
    assert rows[0].relpath == "s/img/a.png" and rows[0].path == str(target.resolve())


def test_relpath_root_only_for_csv():
    from fedhisto.config.study import ConfigError, load_config

    with pytest.raises(ConfigError, match="relpath_root applies only to kind csv"):
        load_config({"cohort": {"real": {"sources": [{"kind": "lc25000", "root": "/x", "relpath_root": "/"}]}}})


def test_duplicate_portable_paths_are_refused(tmp_path: Path):
    root = lc25000_fixture(tmp_path / "lc")
    spec = SourceSpec(kind="lc25000", root=str(root))
    with pytest.raises(SourceError, match=r"share the portable path 'lc25000/lung_aca/lungaca1\.jpeg'"):
        collect_sources([spec, spec])


def test_sources_csv_round_trip(tmp_path: Path):
    rows, _ = read_lc25000(SourceSpec(kind="lc25000", root=str(lc25000_fixture(tmp_path / "lc"))))
    write_sources_csv(tmp_path / "s.csv", rows)
    assert read_sources_csv(tmp_path / "s.csv") == rows
