"""Hand-written documents for the curation tests: good text of several kinds and languages, and
the web noise the filters exist for."""

PROSE = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch. "
    "Later that evening the family gathered to discuss the harvest and the weather ahead. "
    "Rain had been scarce that summer, and the wells were lower than anyone could remember. "
    "Still, the orchard had done well, and the apples were sweeter than they had been in years. "
    "Before going to bed, the farmer wrote a letter to his brother in the city about the season.\n\n"
    "His brother answered a week later with news of the market and of prices that were rising. "
    "He promised to visit in the autumn and to bring the children, who had never seen the farm."
)

TECH_DOC = """Installing the command-line client

The client needs Python 3.10 or newer. Install it from the package index with pip, then check
that the executable is on your PATH:

    pip install example-client
    example --version

Configuration lives in a YAML file. The client looks for it in the current directory first and
then in your home directory. A minimal file names the server and the API key to use:

    server: https://api.example.com
    api_key: ${EXAMPLE_API_KEY}

Run `example sync` to copy the remote project into the local folder. The command is idempotent:
running it twice downloads nothing the second time. Use the --dry-run flag to see what would
change without writing anything, and --verbose to print each file as it is transferred.

If the server rejects the key, the client exits with status 2 and prints the reason. Network
errors are retried three times with exponential backoff before the command gives up.
"""

GERMAN = (
    "Die Stadt liegt am Ufer eines breiten Flusses, der im Frühling oft über die Ufer tritt. "
    "Seit dem Mittelalter leben hier Handwerker, Händler und Fischer, deren Familien zum Teil "
    "noch heute in den alten Häusern am Markt wohnen. Im Sommer kommen viele Besucher, um die "
    "Kirche mit ihren bunten Fenstern zu sehen und auf dem Fluss eine Bootsfahrt zu machen. "
    "Im Winter dagegen ist es ruhig, und nur der Wochenmarkt bringt am Samstag etwas Leben in "
    "die engen Gassen der Altstadt, wo es nach frischem Brot und geröstetem Kaffee duftet."
)

FRENCH = (
    "Le village se trouve au pied d'une colline couverte de vignes et de vergers. Chaque automne, "
    "les habitants se réunissent pour les vendanges, qui durent environ deux semaines. Les enfants "
    "aident à porter les paniers, tandis que les anciens racontent des histoires sur les récoltes "
    "d'autrefois. Le soir, on partage un repas simple sur la place, sous les platanes, et la fête "
    "se prolonge souvent tard dans la nuit avec de la musique et des danses traditionnelles."
)

SPANISH = (
    "La biblioteca municipal abrió sus puertas hace más de cien años gracias a la donación de un "
    "comerciante que había viajado por todo el continente. Hoy conserva miles de libros antiguos, "
    "mapas y cartas que los investigadores consultan con frecuencia. Además, organiza talleres de "
    "lectura para niños y clubes de debate para jóvenes, y los domingos ofrece visitas guiadas en "
    "las que se explica la historia del edificio y de sus colecciones más valiosas."
)

RUSSIAN = (
    "Город был основан на берегу реки более восьмисот лет назад и долгое время оставался важным "
    "торговым центром региона. Здесь сохранились старинные церкви, каменные дома купцов и "
    "деревянные постройки, украшенные резьбой. Летом по реке ходят прогулочные теплоходы, а "
    "зимой жители катаются на коньках по замёрзшему льду. В городском музее можно увидеть "
    "коллекцию икон, старые карты и предметы быта, которые рассказывают о жизни горожан."
)

CHINESE = (
    "这座城市位于长江下游，历史悠久，自古以来就是重要的商业和文化中心。城里保留着许多古老的园林和街道，"
    "每年都吸引大量游客前来参观。春天的时候，河边的柳树发芽，桃花盛开，人们喜欢在傍晚沿着河岸散步。"
    "当地的小吃也非常有名，尤其是汤包和各种用糯米做的点心。近年来，城市发展很快，新建了地铁和博物馆，"
    "但老城区的风貌仍然得到了很好的保护。"
)

JAPANESE = (
    "この町は山と海に囲まれた小さな港町で、昔から漁業が盛んです。朝早く港に行くと、漁師たちが"
    "とれたばかりの魚を運んでいる様子を見ることができます。町の中心には古い神社があり、夏には"
    "大きな祭りが開かれます。祭りの夜には屋台が並び、花火が打ち上げられ、多くの人でにぎわいます。"
    "最近は若い人が都会へ出ていくことが多くなりましたが、町の人々は伝統を大切に守っています。"
)

SPAM = "\n".join(["BUY NOW cheap pills FREE casino WIN WIN click deal !!!"] * 12)
KEYWORDS = " ".join(f"#deal{i} #cheap{i} #win{i}" for i in range(30))
NAVIGATION = "\n".join(
    [
        "Home",
        "About us",
        "Products",
        "Blog",
        "Contact",
        "Login",
        "Sign up",
        "FAQ",
        "Careers",
        "Press",
        "Terms",
        "Sitemap",
    ]
    * 3
)

_SYNONYMS = {
    "quick": "fast",
    "jumps": "leaps",
    "lazy": "idle",
    "farmer": "grower",
    "watches": "observes",
    "evening": "night",
    "family": "household",
    "gathered": "met",
    "discuss": "talk about",
    "harvest": "crop",
    "weather": "climate",
    "scarce": "rare",
    "wells": "springs",
    "remember": "recall",
    "orchard": "grove",
    "apples": "fruit",
    "sweeter": "tastier",
    "letter": "note",
    "brother": "sibling",
    "city": "town",
    "season": "year",
    "answered": "replied",
    "market": "bazaar",
    "prices": "costs",
    "rising": "climbing",
    "promised": "vowed",
    "visit": "come by",
    "children": "kids",
    "farm": "ranch",
    "summer": "hot season",
    "bed": "sleep",
    "years": "ages",
    "news": "word",
    "week": "few days",
}
# PROSE said again in other words: the same meaning, few shared word 5-grams.
PARAPHRASE = (
    " ".join(_SYNONYMS.get(w, w) for w in PROSE.replace(".", " .").replace(",", " ,").split(" "))
    .replace(" .", ".")
    .replace(" ,", ",")
)


def _salad(words: str, per_line: int, lines: int, seed: int) -> str:
    """Keywords drawn at random: web spam with no sentence in it."""
    import random

    rng, pool = random.Random(seed), words.split()
    return "\n".join(" ".join(rng.choice(pool) for _ in range(per_line)) for _ in range(lines))


# keyword salads of several scripts and languages at once, of brand names, of transliterated
# Russian: Lingua names a language for each (Latin, German, Croatian), mostly at full confidence
KEYWORD_SALADS = [
    _salad(
        "casino kasyno kasino казино bonus бонус premio gratis kostenlos darmowe ucretsiz viagra "
        "sildenafil rabatt descuento promo sconto oferta angebot bitcoin btc usdt jackpot gewinnen "
        "ganar wygraj kazan выигрыш",
        90,
        1,
        0,
    ),
    _salad(
        "rolex gucci nike adidas iphone samsung bitcoin ethereum tether binance xiaomi huawei zara "
        "prada dior chanel ps5 xbox netflix spotify tiktok instagram crypto nft usdt vpn",
        9,
        10,
        1,
    ),
    _salad(
        "kupit deshevo skachat besplatno kazino bonus igrat onlain stavki vyigrysh dengi kredit bystro zaim", 12, 8, 2
    ),
]

# short technical notes in German, Polish and Spanish (50-70 words, code names inline)
SHORT_FOREIGN_TECH = [
    "Die Funktion parse_config() liest die YAML-Datei ein und gibt ein Wörterbuch zurück. Fehlt ein "
    "Pflichtschlüssel, wird ein ValueError ausgelöst, der den Namen des Schlüssels und die erlaubten "
    "Werte nennt. Der Parameter strict=True verbietet unbekannte Schlüssel. Beispiel: cfg = "
    'parse_config("train.yaml", strict=True). Die Rückgabe enthält die Abschnitte model, optimizer '
    "und schedule; fehlende Abschnitte werden mit den Standardwerten ergänzt. Die Datei darf höchstens "
    "1 MiB groß sein.",
    "Polecenie pip install lmfoundry instaluje pakiet wraz z zależnościami. Aby uruchomić testy, wpisz "
    "make test w katalogu głównym repozytorium. Zmienna środowiskowa RAY_ADDRESS wskazuje adres "
    "klastra; jeśli jej brak, uruchamiany jest lokalny klaster. Plik konfiguracyjny "
    "configs/pretrain_tiny_cpu.yaml zawiera przykładowe ustawienia dla procesora. Wyniki zapisywane są "
    "w katalogu work/pretrain, a metryki w pliku metrics.jsonl.",
    "Para instalar el paquete, ejecute el siguiente comando en una terminal:\n"
    "pip install lmfoundry\n"
    "La variable de entorno RAY_ADDRESS indica la dirección del clúster; si no está definida, se "
    "inicia un clúster local. El archivo configs/pretrain_tiny_cpu.yaml contiene una configuración de "
    "ejemplo para la CPU. Los resultados se guardan en el directorio work/pretrain y las métricas en "
    "el archivo metrics.jsonl, una línea por paso.",
]
