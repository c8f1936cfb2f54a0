"""scripts/kernel_dev/ncu_stalls.py: an Nsight Compute source page read into loop bodies and a timeline."""
import csv

import ncu_stalls

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_barrier", "stall_mio", "stall_barrier (Not Issued)"]
ROWS = [  # a prologue run once, then a loop body run 8 times: issue, wait, exp2
    ["0x0", "MOV R1, R2", "5", "4", "1", "0", "4", "0"],
    ["0x10", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", "3", "2", "8", "0", "2", "0"],
    ["0x20", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "40", "40", "8", "39", "1", "39"],
    ["0x30", "@P0 MUFU.EX2 R3, R3", "12", "9", "8", "0", "9", "0"],
]


def _page(tmp_path):
    path = tmp_path / "sass.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "gluon_bwd_kernel"])
        w.writerow(HEADER)
        w.writerows(ROWS)
    return path


def test_bodies_group_instructions_by_execution_count(tmp_path, capsys):
    ncu_stalls.main([str(_page(tmp_path))])
    lines = capsys.readouterr().out.splitlines()
    body = next(line for line in lines if line.split()[0] == "8")
    assert body.split()[1:4] == ["3", "55", "91.7%"]          # 3 instructions, 55 of 60 samples
    assert "barrier 71%" in body and "mio 22%" in body          # 39 and 12 of 55
    assert lines.index(body) < next(i for i, line in enumerate(lines) if line.split()[0] == "1")


def test_timeline_lists_the_body_in_program_order(tmp_path, capsys):
    ncu_stalls.main([str(_page(tmp_path)), "--body", "8", "--min", "10"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("3 instructions: ") and "MUFU 1" in out[0]
    assert [line.split(")", 1)[1].split()[0] for line in out[1:]] == ["HGMMA.64x64x16.F32.BF16", "WARPGROUP.DEPBAR.LE", "@P0"]
    assert [int(line.split()[0]) for line in out[1:]] == [3, 43, 55]   # running samples
