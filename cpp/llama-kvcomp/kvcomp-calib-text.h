#pragma once

// The text a model is run over when the library measures its K statistics itself
// (llama_kvcomp_set_k_stats_auto). Written for this project: prose, dialogue, a list, figures,
// code in three languages and a few lines in other languages, so that the K rows it yields
// cover what a model meets in use rather than one register. Changing it changes every
// self-measured statistics file: bump LLAMA_KVCOMP_CALIB_TEXT_VERSION with it.

#define LLAMA_KVCOMP_CALIB_TEXT_VERSION 1

static const char * const llama_kvcomp_calib_text[] = {
R"TXT(The ferry left the harbour at twenty past six, half an hour late, because a lorry carrying crates of apples had slid sideways on the ramp and nobody could agree on who should move it. Mara stood at the rail with her coffee and watched the town shrink behind them: the grey church, the row of painted houses, the crane that had been rusting beside the boatyard for as long as she could remember. The sea was flat and the colour of pewter. Somewhere below deck a child was singing the same three notes over and over.

She had not been back to the island in eleven years. Her brother had written in March to say that the roof of their mother's house had finally given way over the kitchen, and that if nobody came to sort out the furniture and the papers before the autumn storms, there would be nothing left worth sorting. He could not go himself; he had a new job in Rotterdam and a baby who did not sleep. So she had taken two weeks of leave, packed a bag with boots, gloves and a torch, and bought a ticket.

"You'll want the upper deck if the wind gets up," said a man in an orange jacket who was coiling a rope near the lifeboats. "The lower one smells of diesel and the crossing takes three hours."
"Three? It used to be two."
"New engines, old timetable," he said, and laughed as if he had made the joke many times before.

By nine o'clock the island was a low green line on the horizon, and by half past ten she could see the lighthouse, white with a red band, exactly as it appeared on the postcards her mother used to send to everyone at Christmas.

Notes on the house, written that evening in a spiral notebook:
1. Kitchen: roof open over the sink, about 2 m by 3 m. Floorboards soft. Do not stand near the window.
2. Front room: dry. Piano (out of tune, three keys missing), two armchairs, a cabinet full of letters.
3. Bedrooms: damp but sound. Mattresses ruined.
4. Shed: tools, paint tins, a bicycle with no chain, 14 jars of something that may once have been jam.
5. To do tomorrow: call the builder (Mr. Haldane, 01856 772 019), find the deeds, ask at the post office about the water meter.

)TXT",
R"TXT(How a heat pump works, in plain terms. A refrigerator moves heat from the inside of the box to the coil at the back, which is why the coil feels warm. A heat pump does the same thing for a house, only in the other direction: it takes heat from the outside air, the ground or a body of water, and releases it indoors. The trick is a fluid, the refrigerant, that boils at a very low temperature. In the outdoor unit the liquid refrigerant passes through a coil, absorbs heat from the air even when the air is cold, and turns into a gas. A compressor then squeezes the gas, which raises its temperature sharply. The hot gas flows through a second coil inside the house, gives up its heat to the water in the radiators or to the air, and condenses back into a liquid. An expansion valve lowers its pressure again, and the cycle repeats.

The ratio of heat delivered to electricity used is called the coefficient of performance, or COP. A typical air-source unit has a COP of about 3 at an outdoor temperature of 7 degrees Celsius, meaning that 1 kWh of electricity yields roughly 3 kWh of heat. At minus 7 degrees the figure might fall to 2.2, and below minus 15 it can drop further still. Ground-source units are steadier because the soil a metre or two down stays at 8 to 12 degrees all year, but they cost more to install: a borehole of 100 metres can easily cost as much as the pump itself.

| Source | Typical COP | Installed cost (EUR) | Space needed |
|---|---|---|---|
| Air | 2.5 - 3.5 | 9,000 - 14,000 | wall or garden unit |
| Ground, horizontal loop | 3.5 - 4.5 | 15,000 - 22,000 | 400-700 m2 of land |
| Ground, borehole | 3.5 - 4.5 | 18,000 - 28,000 | a drilling rig's access |
| Water | 4.0 - 5.0 | varies | a lake or river nearby |

Q: Why does the efficiency fall when it is colder outside?
A: Because the pump has to lift the heat across a larger temperature difference. The wider the gap between the source and the radiators, the more work the compressor must do for every unit of heat it moves.

Q: Can I keep my old radiators?
A: Often yes, but a heat pump runs best with water at 35 to 45 degrees rather than the 70 degrees a gas boiler supplies, so some rooms may need larger radiators or underfloor heating.

)TXT",
R"TXT(The following function reads a file of measurements, one per line, and returns their mean and standard deviation. Lines that are empty or start with a hash are skipped.

```python
from __future__ import annotations

import math
from pathlib import Path


def summarize(path: Path) -> tuple[float, float]:
    values: list[float] = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            values.append(float(line))
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: not a number: {line!r}") from exc
    if len(values) < 2:
        raise ValueError(f"{path}: need at least two values, got {len(values)}")
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var)


if __name__ == "__main__":
    import sys
    m, s = summarize(Path(sys.argv[1]))
    print(f"mean={m:.4f} sd={s:.4f}")
```

The same idea in C, reading from standard input and using Welford's update so that a long stream does not lose precision:

```c
#include <math.h>
#include <stdio.h>

int main(void) {
    double mean = 0.0, m2 = 0.0, x;
    long n = 0;
    while (scanf("%lf", &x) == 1) {
        n += 1;
        double delta = x - mean;
        mean += delta / n;
        m2 += delta * (x - mean);
    }
    if (n < 2) {
        fprintf(stderr, "need at least two values\n");
        return 1;
    }
    printf("n=%ld mean=%.6f sd=%.6f\n", n, mean, sqrt(m2 / (n - 1)));
    return 0;
}
```

And a small shell pipeline that counts the ten most frequent words in every Markdown file under a folder:

```sh
find docs -name '*.md' -print0 | xargs -0 cat | tr -cs '[:alpha:]' '\n' | tr '[:upper:]' '[:lower:]' | sort | uniq -c | sort -rn | head -10
```

)TXT",
R"TXT(Minutes of the garden committee, Tuesday 14 May, 7.30 pm, in the back room of the library. Present: J. Okafor (chair), P. Lindqvist, R. Moreau, S. Tanaka, D. O'Brien. Apologies: M. Costa.

The chair opened the meeting by thanking everyone who had helped at the spring plant sale, which raised 1,245 pounds, about 300 more than last year. Most of the money will go towards a new water butt and a second compost bay. Ms. Lindqvist reported that the plot at the north end is still waterlogged after the heavy rain in April; she proposed digging a shallow drain along the fence and lining it with gravel. Mr. Moreau asked whether the council would allow it, since the fence belongs to the school. It was agreed that he would write to the head teacher before the next meeting.

Ms. Tanaka raised the question of the waiting list, which now has 23 names on it. Several plots are only half used. After some discussion the committee agreed to offer half plots to the first six people on the list, on a one-year trial. Mr. O'Brien abstained, saying that tenants who had tended their plots for decades should be asked first, not told.

Any other business: the padlock on the tool shed is broken again. The chair will buy a new one. Next meeting: Tuesday 11 June.

Quelques phrases en français pour finir : le jardin ouvre à huit heures, et les enfants de l'école viendront planter des tournesols la semaine prochaine. Auf Deutsch: Bitte schließen Sie das Tor, wenn Sie gehen, damit die Rehe nicht hereinkommen. En español: las semillas de tomate están en la caja azul, junto a las tijeras.

A short history of timekeeping at sea. Until the eighteenth century a ship's navigator could find his latitude from the height of the sun at noon or of the pole star at night, but longitude was another matter. Since the earth turns fifteen degrees every hour, knowing the longitude amounts to knowing the time at a reference place, such as the home port, at the same instant as the local time on board. A pendulum clock could not keep time on a rolling deck, and errors of a few minutes meant errors of many miles. In 1714 the British Parliament offered a prize of up to 20,000 pounds for a practical method. John Harrison, a carpenter from Lincolnshire, spent most of his life building a series of marine timekeepers; the fourth, finished in 1759 and not much larger than a pocket watch, lost only five seconds on a voyage to Jamaica that lasted 81 days. Astronomers preferred the method of lunar distances, which used the moon's position against the stars as a clock in the sky, and the argument between the two camps lasted for decades. In the end the chronometer won, because it was simpler to use and its price fell as makers learned to build it in numbers.

)TXT",
};
